"""The public import path of the adapter for mindcv's trainer: ``ms_gradaccum.adapters.mindcv`` (its documentation
there)."""
from ms_gradaccum.adapters.mindcv import *  # noqa: F401,F403
from ms_gradaccum.adapters.mindcv import __all__  # noqa: F401
