"""What the loss network's graph decides (``diagnostics.graph_contract``'s reading) for a package cell, and the message
of each stop: :func:`decided`."""
from ms_gradaccum.core.kinds import RowMean
from ms_gradaccum.diagnostics.graph_contract import GraphReading, agrees, built_in, place


class LossContractError(ValueError):
    """The loss does not combine over micro-batches as the cell combines it (raised before any update)."""


def routes(public: bool) -> tuple:
    """``(token route, sum route)`` in the arguments of the entry point the message is for."""
    if public:
        return ("return (loss_sum, count) from the network and pass kind=ms_gradaccum.TokenMean()",
                "kind=ms_gradaccum.RowSum()")
    return ("return (loss_sum, count) from the network and pass per_token_loss=True (min_count=1.0 for a "
            "max(count, 1) floor)", "reduction='sum'")


def taken_as(check, kind) -> str:
    if check.declared:
        return f"the cell was told the loss is {kind.description}"
    return f"the cell takes the loss for {kind.description}"


def beyond_parallel_pass(check, kind) -> str:
    """The stop where the loss is a kind MindSpore's semi-auto/auto-parallel pass cannot train (it averages the
    micro-batches' losses: a row mean only)."""
    return (f"For '{check.owner_name}', the loss of {check.loss_name} is {kind.description}, as read from the loss "
            f"network's graph, but under semi-auto/auto parallel MindSpore's parallel pass weighs each micro-batch's "
            f"loss 1/micro_size (a mean over rows), which would not give the full batch's update. Return a mean over "
            f"the rows, train with micro_size=1, or train data parallel (where the cell trains this kind exactly).")


def declare_kind(check, kind) -> str:
    """The stop where the graph, read after a compile the batch did not reach beforehand, shows a kind other than the
    one that graph trains (a train cell of one's own, sink mode): the argument that declares it."""
    return (f"For '{check.owner_name}', the loss of {check.loss_name} is {kind.description}, as read from the loss "
            f"network's graph, but {taken_as(check, check.kind)}, and the graph was compiled so before the cell could "
            f"read it (the batch reaches the cell only inside the graph: a train cell of one's own, sink mode). "
            f"Declare it: {kind.declaration()}. Nothing was trained.")


def decided(check, reading: GraphReading, public: bool):
    """The kind `check`'s cell trains with, as `reading` shows the loss; raises :class:`LossContractError` where the
    rows are coupled, the loss is not one kind the cell can count, or it contradicts what the user declared; None
    where the graph leaves it undecided and nothing random is drawn (the value comparison decides then)."""
    kind, owner, name = check.kind, check.owner_name, check.loss_name
    token, total = routes(public)
    if (reading.outputs > 1) != kind.returns_count:
        return None   # the outputs are not what the cell expects: its own check says so, on the first pass
    if reading.coupled is not None:
        coupled = reading.coupled
        later = "" if public else (" check_loss=False would train another objective (the mean of micro-batch "
                                   "losses), not this one.")
        raise LossContractError(
            f"For '{owner}', the loss of {name} couples the rows of a batch, so no split into micro-batches gives the "
            f"full batch's update: train with micro_size=1 (a smaller batch if memory is short), or a loss whose rows "
            f"are independent. Read from the loss network's graph: {coupled.why}, at {coupled.op} in "
            f"{place(coupled.scope)}. Losses over the batch's rows together (InfoNCE over its similarity matrix, "
            f"mining over the batch, statistics over the batch inside the network) are such losses.{later}")
    if kind.counts_in_network and reading.normalised:
        return kind   # a recognised loss cell counts what the graph cannot replay (class weights): exact as before
    if reading.stop and not reading.normalised:
        raise LossContractError(
            f"For '{owner}', the loss of {name} is not one kind the cell can combine over micro-batches: "
            f"{reading.stop}. {token.capitalize()} (each term's sum, and the count it is divided by), or train with "
            f"micro_size=1. Read from the loss network's graph.")
    if reading.stop:
        raise LossContractError(
            f"For '{owner}', the loss of {name} is normalised over the batch by what the cell cannot count from the "
            f"inputs alone: {token}, so that the batch's sum is divided by the batch's count. Read from the loss "
            f"network's graph: {reading.stop}. Where that normaliser carries a gradient (a Dice loss), no split of "
            f"the rows reproduces the full batch: train with micro_size=1.")
    found = reading.kind
    if found is None:
        if not reading.random or (check.declared or not built_in(kind)):
            return None if not reading.random else kind
        raise LossContractError(
            f"For '{owner}', the loss contract of {name} cannot be read from its graph ({reading.unread}), and the "
            f"network draws random values ({', '.join(reading.random)}), so comparing its values cannot settle it "
            f"either: say what the loss is. A mean over the rows: kind=ms_gradaccum.RowMean(); a sum over them: "
            f"{total}; a mean over a count of its own: {token}.")
    if kind.counts_in_network:
        # A recognised loss cell counts what it divides by; where several do, a count the graph shows taken from the
        # inputs serves every one on those labels (two heads on the same labels), counted by the package instead.
        counted = found.counted_input() is not None
        if counted and len(kind.cells) > 1:
            return found
        return kind if counted or found == RowMean() else None
    if not built_in(kind):
        return kind   # a kind of one's own: declared, and the graph shows the rows are not coupled
    if kind.returns_count and not found.returns_count:
        raise LossContractError(
            f"For '{owner}', the loss of {name} is {found.description}, but {taken_as(check, kind)}: return the sum "
            f"over the rows and the count, not their mean, or leave per_token_loss unset and the cell trains it as "
            f"what it is. Read from the loss network's graph.")
    if check.declared and not agrees(found, kind):
        undeclared = "pass kind=None" if public else "leave per_token_loss, reduction and kind unset"
        raise LossContractError(
            f"For '{owner}', the loss of {name} is {found.description}, but {taken_as(check, kind)}: {undeclared} "
            f"and the cell trains it as what it is (counted per micro-batch on every step), or {token}. Read from the "
            f"loss network's graph.")
    if found.returns_count and kind.returns_count:
        return kind   # the floor and the sum are the user's
    return found


def values_message(check, pair: int, start: int, stop: int, measured: float, predicted: float, sizes: list, kind,
                   public: bool) -> str:
    """The stop where the value comparison (undecided by the graph) finds that micro-batches `pair` and
    ``pair + 1`` together (rows `start` to ``stop - 1``) do not give what their own losses combine to as `kind`."""
    token, total = routes(public)
    rows = sizes[pair] + sizes[pair + 1]
    where = (f"on micro-batches {pair} and {pair + 1} together (rows {start} to {stop - 1}) its loss is "
             f"{measured:.4g}, but {predicted:.4g} combined from their own losses as {taken_as(check, kind)}")
    ratio = measured / predicted if predicted else None
    if ratio is not None and abs(ratio - rows / max(sizes[pair], sizes[pair + 1])) < 0.05 * ratio:
        return (f"For '{check.owner_name}', the loss of {check.loss_name} grows with the rows it is given (a sum, or a "
                f"mean times the batch size): pass {total}. Found on the first call: {where}.")
    return (f"For '{check.owner_name}', the loss of {check.loss_name} does not combine over micro-batches: if it is "
            f"normalised by something taken over the batch, {token}; if it is a sum, pass {total}. Found on the first "
            f"call: {where} (a count of thresholded targets, or labels left out, do this).")
