"""Diagnostics beside the step: the loss contract's check (``contract``; public on a batch of one's choosing:
``loss_contract``), when it runs (``calls``), the context added to an error the network raises on a micro-batch
(``failures``), and the one place the network runs eagerly (``eager``).
The engine knows none of them but the check's in-graph pass, which it holds where the batch cannot be reached."""
