"""Diagnostics beside the step: the loss contract's reading (``contract``; public on a batch of one's choosing:
``loss_contract``), what the cells call of it and of the error context (``calls``), the context added to an error the
network raises on a micro-batch (``failures``), and the one place the network runs eagerly (``eager``). They import
the core; the core imports none of them. The cells hold the contract's check (its in-graph comparison, for where the
batch cannot be reached from Python) and call it."""
