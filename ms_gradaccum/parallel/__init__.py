"""The parallel modes, each imported only in its mode: data parallel's cross-rank parts (``data_parallel``) and the
hand-over to MindSpore's semi-auto/auto-parallel pass (``parallel_pass``). This package imports neither."""
