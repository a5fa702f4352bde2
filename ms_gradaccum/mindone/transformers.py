"""The public import path of the adapter for mindone's Transformers Trainer:
``ms_gradaccum.adapters.mindone.transformers`` (its documentation there)."""
from ms_gradaccum.adapters.mindone.transformers import *  # noqa: F401,F403
from ms_gradaccum.adapters.mindone.transformers import __all__  # noqa: F401
