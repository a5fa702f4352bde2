"""A Cell's internals the package reads or writes. Checked 2.7.0-2.10.0."""
from mindspore import nn

# The flags Cell.to_float sets on every cell of a tree (``amp_level`` O2/O3 call it): a flagged cell casts every float
# tensor it handles. mindspore/nn/cell.py::to_float.
PRECISION_FLAGS = ("fp16", "fp32", "bf16")


def own_parameters(cell: nn.Cell) -> dict:
    """The dict of the Parameters `cell` holds itself (``Cell._params``), to add and drop buffers by name in place:
    ``insert_param_to_cell`` adds, and nothing public removes one."""
    return cell._params  # pylint: disable=protected-access
