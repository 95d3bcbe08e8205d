"""Testing tools for tev-jax and its extensions.

- `check_lossless` / `assert_lossless`: the exactness harness, a chi-square test of a
  verifier's (exit node, bonus token) law against the exact law (`tev_jax.testing.lossless`
  states the statistics and the measured power)::

      from tev_jax.testing import assert_lossless
      assert_lossless(my_verifier, tree, target_logits_NV, Sampling(1.0), horizon=3)

- `tev_jax.testing.reference`: slow float64 numpy references (the exit law from its
  definitions, the exact joint law, continuation enumeration, loop verifiers).
- `tev_jax.testing.heap_ddtree`: the plain best-first heap DDTree builder (``heapq``), the
  slot-for-slot reference of the jitted `tev_jax.ddtree`.
- `tev_jax.testing.drafters`: drafters good or bad by construction (`OracleDrafter`
  drafts with the target itself), to test and time the decode engine with long blocks.
- `tev_jax.testing.strategies`: hypothesis strategies for random valid trees and
  logits. It is the only module here that needs ``hypothesis`` (the ``test`` extra), so
  it is not imported by this package: ``from tev_jax.testing import strategies``.
"""

from tev_jax.testing import reference
from tev_jax.testing.lossless import (
    LosslessReport,
    assert_lossless,
    check_lossless,
    chi_square,
    draw_verdicts,
    exact_law,
)

__all__ = [
    "LosslessReport", "assert_lossless", "check_lossless", "chi_square", "draw_verdicts",
    "exact_law", "reference",
]
