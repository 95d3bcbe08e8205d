"""Moved to `tev_jax.testing.strategies`; kept so that tests written before the move run."""

from tev_jax.testing.strategies import *  # noqa: F403
