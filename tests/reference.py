"""Moved to `tev_jax.testing.reference`; kept so that tests written before the move run."""

from tev_jax.testing.reference import *  # noqa: F403
