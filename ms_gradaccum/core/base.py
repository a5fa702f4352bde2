"""Two small bases the package's cells share: :class:`PrecisionNeutral`, the machinery ``to_float`` passes through,
and :class:`Unsaved`, a Parameter held out of the cell tree (and out of checkpoints)."""
from mindspore import nn, Parameter

from ms_gradaccum._mindspore.surroundings import PRECISION_FLAGS


class PrecisionNeutral(nn.Cell):
    """A cell of the package's machinery, which ``to_float`` (``amp_level`` O2/O3) passes through to the network: a
    flagged cell would cast the float32 sums and the scale too ("Type Join Failed: Float32, Float16")."""

    def add_flags_recursive(self, **flags):
        self.add_flags(**{key: value for key, value in flags.items() if key not in PRECISION_FLAGS})
        for cell in self.cells():
            cell.add_flags_recursive(**flags)
        return self


class Unsaved:
    """Holds a Parameter out of the cell tree (``accu_state.*_checked`` flags, the loss contract's step count): not in
    ``get_parameters()``, so checkpoints do not carry it."""

    def __init__(self, parameter: Parameter):
        self.parameter = parameter
