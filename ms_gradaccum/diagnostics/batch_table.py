"""The batch-axis table: for each primitive of a loss network's frontend graph, the rule that gives the state of its
output (``diagnostics.batch_axis`` defines the states) from its inputs', and :func:`analyse`, the walk over the graph.

The contract of every rule, up front:

- *Row-wise* (element-wise arithmetic, comparisons, casts, activations, selections): the rows stay on their axis;
  rows on different axes meet only in a transposed batch (coupled); a reduction over the rows used on each row is
  statistics over the batch (coupled). On reductions, only linear ops keep a combination of them.
- *Shape ops*: a reshape that keeps whole rows on its first axis larger than 1 (``(B, T, V) -> (B*T, V)``), a
  transpose, a slice that keeps every row, a gather by the rows' indices, a concatenation or split along another axis
  keep the rows; anything else couples them.
- *Reductions*: a sum or mean over axes with the rows gives a :class:`Reduced` sum or mean (a division by a constant
  proportional to the rows is a mean); max, min, prod, norms, arg-max over them couple the rows; over other axes they
  are row-wise. Softmax, cumulative sums, sort and top-k along the rows couple them.
- *Matrix products*: rows on a free axis of one operand (the other fixed), or on a batch axis of both, stay rows; rows
  on a contracted axis, or meeting other rows, couple them (a similarity over the batch).
- *Per-sample ops* (convolutions, pooling, LayerNorm and GroupNorm over the axes after the rows, BatchNorm whose
  statistics are the separate, warned case): row-wise with the rows first.
- *Loss primitives* with a reduction argument: none, a sum or a mean over the rows.
- *Random draws* and values made from no row's data (zeros, ranges, shapes): fixed; dropout is row-wise.
- Control flow (Switch, Partial, a call of a computed graph) is :class:`Unknown`; any other primitive is fixed where
  no input carries rows, else :class:`Unknown` (the contract is then not read from the graph).
"""
import dataclasses

from ms_gradaccum._mindspore.frontend import CALL, NOT_A_VALUE, Graph
from ms_gradaccum._mindspore.step_graph import GUARD_OP
from ms_gradaccum.diagnostics import batch_rules as _r
from ms_gradaccum.diagnostics.batch_axis import (Context, Coupled, Fixed, Many, Reduced, Rows, Unknown, elementwise)

_ELEMENTWISE = (
    "Add Sub Mul Div RealDiv Muls Adds Subs AddExt SubExt Neg Exp Exp2 Expm1 Log Log1p Log2 Sqrt Rsqrt Square Pow "
    "PowTensorScalar PowScalarTensor Abs Sigmoid Tanh ReLU ReLU6 ReLUV2 GeLU GeLUExt FastGeLU FastGelu SiLU Swish "
    "HSwish HSigmoid HShrink Softplus SoftplusExt Erf Erfc Maximum Minimum LogicalAnd LogicalOr LogicalXor Select "
    "Where Clip ClampScalar ClampTensor Sign Floor Ceil Round Trunc Reciprocal Xlogy Sin Cos Tan Atan Atan2 "
    "FloorDiv FloorMod Mod Remainder LeakyReLU LeakyReLUExt Elu EluExt Mish Softsign SeLU CeLU Lerp LerpScalar "
    "IsNan IsFinite IsInf IsClose SquaredDifference BiasAdd Tril Triu TrilExt TriuExt BroadcastTo LogSigmoid "
    "SigmoidCrossEntropyWithLogits DropoutDoMask MaskedSelectGrad Addcmul Addcdiv AddScalar SubScalar Divs "
    "InplaceAddExt InplaceMul InplaceDiv InplaceSubExt Threshold ReluGrad Softshrink GLU Frac LogAddExp LogAddExp2"
).split()
_FIXED = (
    "Zeros Ones ZerosLike OnesLike ZerosLikeExt OnesLikeExt Fill FillV2 FillScalar FillTensor Arange Range Eye Shape "
    "TensorShape ScalarToTensor TupleToTensor Linspace FullLike NewOnes NewZeros UpdateState DropoutGenMask "
    "StandardNormal UniformReal UniformInt RandomStandardNormal Randn RandExt RandLikeExt RandnLike RandInt "
    "RandIntLike NormalFloatFloat NormalTensorTensor NormalTensorFloat NormalFloatTensor RandpermExt Randperm"
).split()
_PER_SAMPLE = (
    "Conv2D Conv2DExt Conv1DExt Conv3D Convolution Conv2DTranspose Conv2DBackpropInput MaxPool MaxPoolWithArgmax "
    "AvgPool AvgPool2D AdaptiveAvgPool2D AdaptiveAvgPool2DExt AdaptiveAvgPool1D ResizeBilinear ResizeBilinearV2 "
    "ResizeNearestNeighbor UpsampleNearest2D UpsampleBilinear2D PadV3 Pad ConstantPadND ReflectionPad2d LayerNorm "
    "LayerNormExt LayerNormV3 RmsNorm GroupNorm BatchNorm BatchNormExt InstanceNorm DepthToSpace SpaceToDepth Im2Col"
).split()
RANDOM = frozenset((
    "Dropout DropoutExt DropoutGenMask StandardNormal UniformReal UniformInt RandomStandardNormal Randn RandExt "
    "RandLikeExt RandnLike RandInt RandIntLike NormalFloatFloat NormalTensorTensor NormalTensorFloat NormalFloatTensor "
    "RandpermExt Randperm Multinomial MultinomialExt Bernoulli BernoulliExt RandomCategorical Gamma Poisson"
).split())

# Control flow: the branch taken is a value; what it computes is not read (the contract is then undecided).
CONTROL = frozenset(("Switch", "SwitchLayer", "Partial", "While", "J", "ZerosLikeGraph", CALL))

RULES = dict(
    {op: elementwise for op in _ELEMENTWISE},
    **{op: _r._fixed for op in _FIXED},
    **{op: (lambda ctx, step=_r._compare_step: elementwise(ctx, step)) for op in _r.COMPARE},
    Cast=lambda ctx: elementwise(ctx, _r._cast_step),
    LogicalNot=lambda ctx: elementwise(ctx, _r._not_step),
    MaskedFill=lambda ctx: elementwise(ctx, _r._fill_step),
    **{op: _r._reshaped for op in "Reshape ExpandDims Squeeze Flatten Unsqueeze View".split()},
    Transpose=_r._transposed,
    **{op: _r._sliced for op in "StridedSlice SliceExt Slice Narrow".split()},
    **{op: _r._reduction(True) for op in "SumExt ReduceSum".split()},
    **{op: _r._reduction(True, averaging=True) for op in "MeanExt ReduceMean".split()},
    **{op: _r._reduction(False) for op in "ReduceMax ReduceMin ReduceProd ReduceAll ReduceAny ProdExt ArgMaxExt Argmax "
                                          "Argmin ArgMaxWithValue ArgMinWithValue MaxDim MinDim LpNorm Norm "
                                          "LinalgVectorNorm LogSumExp ReduceStd StdMean VarMean Std Var".split()},
    **{op: _r._reduction(False, axes_at=None) for op in "Max Min".split()},
    **{op: _r._along(1) for op in "Softmax LogSoftmax LogSoftmaxExt SoftmaxExt CumSum CumsumExt Cummax Cummin Sort "
                                   "L2Normalize LogCumsumExp".split()},
    **{op: _r._along(None) for op in ("TopK",)},
    TopkExt=_r._along(2),
    MatMul=_r._matmul(2), BatchMatMul=_r._matmul(2), MatMulExt=_r._matmul(None), BatchMatMulExt=_r._matmul(None),
    Gather=_r._gathered, GatherD=_r._gathered_d, OneHot=_r._one_hot, OneHotExt=_r._one_hot,
    **{op: _r._joined for op in "Concat Stack StackExt".split()},
    **{op: _r._split for op in "Split SplitWithSize SplitTensor Chunk".split()},
    **{op: _r._per_sample for op in _PER_SAMPLE},
    Dropout=_r._with_mask(elementwise), DropoutExt=_r._with_mask(elementwise),
    SparseSoftmaxCrossEntropyWithLogits=_r._loss_primitive(None, mean_by_default=True),
    SoftmaxCrossEntropyWithLogits=_r._per_row_loss,
    BinaryCrossEntropy=_r._loss_primitive(3), BCEWithLogitsLoss=_r._loss_primitive(4),
    BinaryCrossEntropyWithLogits=_r._loss_primitive(4), SmoothL1Loss=_r._loss_primitive(3),
    L1LossExt=_r._loss_primitive(2), MSELossExt=_r._loss_primitive(2), KLDivLoss=_r._loss_primitive(2),
    CTCLossV2=_r._ctc,
    Load=_r._first, Depend=_r._first, Identity=_r._first, StopGradient=_r._detached,
    # The package's own: a recognised loss's counting copy divides by its count, guarded against 0 (core.tokens).
    **{GUARD_OP: lambda ctx: ctx.states[1]},
)


@dataclasses.dataclass(frozen=True)
class Reading:
    """What the walk found: the output's `state`, the random primitives met, the primitives met without a rule on
    rows (``(op, scope)``), and every primitive met."""
    state: object
    random: tuple
    unruled: tuple
    ops: frozenset


def _shape(graph: Graph, shapes: dict, name: str):
    value = graph.values.get(name)
    if value is not None:
        return value.shape
    return shapes.get(name)


def analyse(graph: Graph, split: dict, rows: int, literals: frozenset = frozenset()) -> Reading:
    """The state of `graph`'s output: `split` maps the graph's input names to the network's input positions of the
    inputs split along axis 0 (the others are given whole); `rows` the rows of the micro-batch it was compiled on;
    `literals` the nodes whose constant factor does not change with the rows (``Reduced.divisions``)."""
    states = {name: Fixed(True) for name in graph.weights}
    for name in graph.inputs:
        states[name] = Rows(0, False, (split[name], ())) if name in split else Fixed()
    shapes, random, unruled = {}, [], []
    for index, node in enumerate(graph.nodes):
        inputs = node.inputs
        given = [states.get(name, Fixed()) for name in inputs]
        shapes[node.name] = node.out.shape
        if node.op in RANDOM:
            random.append(node.op)
        if node.op == "MakeTuple" or node.op == "MakeList":
            states[node.name] = Many(tuple(given))
            continue
        if node.op in ("TupleGetItem", "ListGetItem"):
            index = graph.constants.get(inputs[1]) if len(inputs) > 1 else None
            whole = given[0] if given else Fixed()
            states[node.name] = whole.items[index] if isinstance(whole, Many) and isinstance(index, int) and \
                index < len(whole.items) else whole
            continue
        if node.op == "Switch" and given and isinstance(given[0], (Coupled, Reduced)):
            # The branch taken depends on a value over the rows: a micro-batch may take another than the batch.
            states[node.name] = Coupled(node.op, node.scope, "a branch on a value taken over the rows (the form of "
                                                             "the loss depends on the batch's values)")
            continue
        if node.op in CONTROL:
            dead = _r._first_dead(given)
            states[node.name] = dead if isinstance(dead, Coupled) else Unknown(
                node.op, node.scope, "control flow (a branch or a loop on the values)")
            unruled.append((node.op, node.scope))
            continue
        constants = [graph.constants.get(name, NOT_A_VALUE) for name in inputs]
        ctx = Context(node, given, [_shape(graph, shapes, name) for name in inputs], constants, rows,
                      node_index=index, literals=literals)
        rule = RULES.get(node.op)
        if rule is not None:
            states[node.name] = rule(ctx)
        elif any(isinstance(s, (Rows, Reduced, Many)) for s in given):
            unruled.append((node.op, node.scope))
            states[node.name] = Unknown(node.op, node.scope)
        else:
            dead = _r._first_dead(given)
            states[node.name] = dead if dead is not None else Fixed(_r._weights(given))
    return Reading(states.get(graph.output, Unknown("?", "", "no output")), tuple(random), tuple(unruled),
                   frozenset(node.op for node in graph.nodes))
