"""The public import path of the adapter for mindocr's train step: ``ms_gradaccum.adapters.mindocr`` (its documentation
there)."""
from ms_gradaccum.adapters.mindocr import *  # noqa: F401,F403
from ms_gradaccum.adapters.mindocr import __all__  # noqa: F401
