"""Diagnostics beside the step: the loss contract's first-call probe (``contract``; public on a batch of one's choosing:
``loss_contract``), when it runs (``calls``), the context added to an error the network raises on a micro-batch
(``failures``), and the one place the network runs eagerly (``eager``). The engine holds the contract's in-graph
comparison, for where the batch cannot be reached from Python, and nothing else of them."""
