"""The public import path of the adapter for mindone's diffusion train step: ``ms_gradaccum.adapters.mindone`` (its
documentation there)."""
from ms_gradaccum.adapters.mindone import *  # noqa: F401,F403
from ms_gradaccum.adapters.mindone import __all__  # noqa: F401
