"""The accumulation itself, independent of how a cell is wrapped or found: splitting a batch (``microbatch``), the
micro-batch loop (``engine``), the buffers and every write into them (``buffers``), what a loss is and how its
micro-batches combine (``kinds``; the losses recognised in a network: ``tokens``, ``token_sum``), the loss scale
(``loss_scale``), a window of several batches (``window``), argument checks and their one message format
(``validation``), and the cells' shared bases (``base``). Imports nothing of ``cells``, ``parallel``, ``diagnostics``
or ``adapters``."""
