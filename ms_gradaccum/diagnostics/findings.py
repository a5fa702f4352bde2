"""What the loss contract found (a typed record ``check_loss_contract`` reports), and the names and layout it is kept
under."""
import dataclasses
from typing import Optional

from mindspore import nn, Tensor


@dataclasses.dataclass(frozen=True)
class Findings:
    """What the contract's reading found (``check_loss_contract`` reports it).

    Attributes:
        kind (LossKind): The kind the cell trains with (the one the graph shows, where it shows one).
        separable (Optional[bool]): Whether the rows are independent, as read from the graph; None where the graph
            left it to the value comparison.
        ignore_labels (Optional[int]): The input whose ignored labels the loss leaves out (then counted), if any.
        random (bool): The network draws random values (then no values are compared).
        rows_compared (int): The rows whose values were compared (every row of the batch, or 0).
        batch_rows (int): The rows of the batch read.
        measured (float): The loss on the pair of micro-batches whose comparison was closest to failing.
        predicted (float): The same, combined from the two micro-batches' own losses.
        not_finite (Optional[int]): The first micro-batch whose loss is not finite (nothing compared then).
    """
    kind: object
    separable: Optional[bool]
    ignore_labels: Optional[int]
    random: bool
    rows_compared: int
    batch_rows: int
    measured: float = float("nan")
    predicted: float = float("nan")
    not_finite: Optional[int] = None
    read_from_graph: bool = False
    graph: object = None


def loss_name(network: nn.Cell) -> str:
    """The network's class, and its loss cell's (the last ``nn.LossBase`` in it), for messages."""
    losses = [type(cell).__name__ for name, cell in network.cells_and_names() if isinstance(cell, nn.LossBase) and name]
    return type(network).__name__ + (f" ({losses[-1]})" if losses else "")


def input_layout(inputs: tuple) -> tuple:
    """What the contract's reading holds for (PyNative reads it again when it changes): each input's dtype and rank."""
    return tuple((x.dtype, x.ndim) if isinstance(x, Tensor) else type(x) for x in inputs)
