"""The public import path of the adapter for MindFormers' Trainer: ``ms_gradaccum.adapters.mindformers`` (its
documentation there)."""
from ms_gradaccum.adapters.mindformers import *  # noqa: F401,F403
from ms_gradaccum.adapters.mindformers import __all__  # noqa: F401
