"""Data parallel: what crosses devices, once per optimizer step (or once per job); imported in that mode only.

- :class:`TokenTotals`: the loss value and count of token losses summed over devices in one 2-float all-reduce.
- :class:`InPlaceAllReduce`: the gradient all-reduce of ``nn.DistributedGradReducer``, done in place on buffers.
- :class:`ReplicaCheck`: at the first step, all ranks must hold the same weights (one small all-gather, once).
- :func:`check_data_parallel_ready`: refuses data parallel without ``mindspore.communication.init()``.
"""
from typing import Callable

import mindspore as ms
from mindspore import nn, ops, Parameter, Tensor
from mindspore.common import dtype as mstype
from mindspore.communication import get_group_size

from ms_gradaccum._mindspore.graph import compile_time
from ms_gradaccum._mindspore.parallel import communication_initialized, reducer_all_reduces
from ms_gradaccum._mindspore.surroundings import data_parallel_in_force
from ms_gradaccum.core.base import PrecisionNeutral, Unsaved


def check_data_parallel_ready(cls_name: str) -> None:
    """A clear error when data parallel is in force but communication was never initialised."""
    if data_parallel_in_force() and not communication_initialized():
        raise RuntimeError(
            f"For '{cls_name}', the parallel mode is data_parallel but mindspore.communication.init() has not been "
            f"called, so there is no group to reduce the gradients over (MindSpore would crash at the first step). "
            f"Call init() before training, and start the job with msrun or mpirun; or remove "
            f"set_auto_parallel_context(parallel_mode='data_parallel') to train on one device.")


class TokenTotals(PrecisionNeutral):
    """``(global value, global count, gradient factor)`` from this device's sums, for loss kinds whose count is taken
    over the batch (``sums_across_ranks``: token losses).

    The factor is the device count when the wrapping reducer averages gradients over devices (``gradients_mean``)
    and 1 otherwise, so that ``factor * local_gradient_sum / global_count``, reduced by the wrapper, equals the
    global batch's ``sum(gradients) / sum(count)``. Stand-alone, and for row losses (whose per-device mean the
    reducer averages, as in plain data-parallel training), everything passes through.
    """

    def __init__(self, kind, cls_name: str):
        super().__init__(auto_prefix=False)
        self.sums_across_ranks = kind.sums_across_ranks
        self.owner_name = cls_name
        self.all_reduce = ops.AllReduce()

    @compile_time
    def reduced(self) -> bool:
        return self.sums_across_ranks and data_parallel_in_force()

    @compile_time
    def factor(self) -> float:
        if self.reduced and ms.get_auto_parallel_context("gradients_mean"):
            return float(get_group_size())
        return 1.0

    def construct(self, value, count):
        if self.reduced:
            both = self.all_reduce(ops.stack((value, count)))
            return both[0], both[1], self.factor
        return value, count, self.factor


class InPlaceAllReduce(PrecisionNeutral):
    """The all-reduce of a train cell's ``DistributedGradReducer``, done in place on Parameter buffers.

    The reducer all-reduces each gradient into a new tensor and, when ``gradients_mean`` is set, multiplies that
    by ``1 / group_size`` into another; the optimizer then holds all of them until its last update. A train cell
    whose gradient sits in ``accu_grads`` buffers can instead write each sum back into its buffer, one buffer
    after another, so that only one gradient-sized temporary exists at a time and the optimizer reads the
    buffers themselves. Same all-reduce primitives and the same filter of ``layerwise_parallel`` weights as the
    reducer; the caller divides by :attr:`devices` when the reducer averages.
    """

    def __init__(self, reducer: nn.DistributedGradReducer):
        super().__init__(auto_prefix=False)
        self.reduce, self.all_reduces, averages, devices = reducer_all_reduces(reducer)
        self.devices = devices if averages else 1.0

    def construct(self, buffers, after):
        """Sums every buffer across devices in place, once ``after`` exists; returns ``after`` after the writes."""
        for j in range(len(buffers)):
            if self.reduce[j]:
                buffer = buffers[j]
                # Writes to Parameters run in program order, so each read follows the previous write.
                after = ops.depend(after, ops.assign(buffer, self.all_reduces[j](ops.depend(buffer, after))))
        return after


# Samples taken from every weight: exact values, compared exactly (no reduction order can differ).
_SAMPLES = 4


class ReplicaCheck(PrecisionNeutral):
    """Under data parallel, at the first step: the same weights on every rank, or a clear error before training.

    Each rank takes a fingerprint of every weight it trains (a few of its values, exactly, and its sum of squares)
    and the fingerprints are all-gathered once. A rank whose weights differ from rank 0's stops the job with the
    name of the first differing parameter, before any update. Ranks that built their networks without a common seed
    would otherwise train as different models, silently. Layerwise-parallel weights (never all-reduced) are not
    compared. The "checked" flag is not a Parameter of the cell, so it is not in checkpoints: every new cell checks.
    """

    def __init__(self, targets: Callable, cls_name: str):
        super().__init__(auto_prefix=False)
        object.__setattr__(self, "_targets", targets)   # a bound method of the owner: (weights, buffers)
        self.owner_name = cls_name
        self._checked = Unsaved(Parameter(Tensor(False), name="accu_state.replicas_checked", requires_grad=False))
        # Built only once the communication is up (cells.grad_accumulation binds it so): the primitive reads the
        # group size when created (1 before init()).
        self.all_gather = ops.AllGather()

    @compile_time
    def active(self) -> bool:
        return data_parallel_in_force() and bool(self.names)

    @compile_time
    def compared(self):
        """The weights all-reduced by data parallel (not layerwise-parallel ones)."""
        return tuple(weight for weight in self._targets()[0] if not weight.layerwise_parallel)

    @compile_time
    def names(self) -> tuple:
        return tuple(weight.name for weight in self.compared)

    @compile_time
    def checked(self) -> Parameter:
        return self._checked.parameter

    def _fingerprint(self):
        rows = ()
        for weight in self.compared:
            flat = ops.cast(weight, mstype.float32).reshape(-1)
            size = flat.shape[0]
            picks = ()
            for k in range(_SAMPLES):
                picks += (flat[(size - 1) * k // (_SAMPLES - 1)],)
            rows += (ops.concat((ops.stack(picks), ops.reshape((flat * flat).sum(), (1,)))),)
        return ops.stack(rows)

    def construct(self, after):
        if self.active:
            checked = self.checked
            if not checked:
                prints = self._fingerprint()                                    # (weights, samples + 1)
                gathered = self.all_gather(prints).reshape((-1,) + prints.shape)  # (ranks, weights, samples + 1)
                first = gathered[0]
                samples_differ = (gathered[:, :, :_SAMPLES] != first[:, :_SAMPLES]).any(axis=2)
                squares = gathered[:, :, _SAMPLES]
                squares_differ = ops.abs(squares - first[:, _SAMPLES]) > 1e-5 * ops.abs(first[:, _SAMPLES]) + 1e-30
                differ = ops.logical_or(samples_differ, squares_differ)       # (ranks, weights)
                if differ.any():
                    rank = ops.argmax(ops.cast(differ.any(axis=1), mstype.int32))
                    index = ops.argmax(ops.cast(differ[rank], mstype.int32))
                    raise ValueError(
                        f"For '{self.owner_name}', data-parallel ranks must start from the same weights, but parameter "
                        f"'{self.names[index]}' differs between rank 0 and rank {rank}, so the ranks would train as "
                        f"different models. Call mindspore.set_seed(<same seed>) on every rank before building the "
                        f"network, or load the same checkpoint on every rank.")
                after = ops.depend(after, ops.assign(checked, Tensor(True)))
        return after
