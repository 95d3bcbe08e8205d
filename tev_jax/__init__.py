"""tev-jax: tree speculative decoding with Tree Exit Verification in JAX.

The paper's §3 (canonical exit law) is `tev_jax.exit_law`, §4 (exact verifiers, TEV)
is `tev_jax.verify`, DDTree's best-first builder is `tev_jax.ddtree`; draft trees are
`tev_jax.tree.DraftTree`, and the target's sampling transform is `tev_jax.sampling`.
"""

from tev_jax.sampling import Sampling
from tev_jax.tree import DraftTree, make_tree, validate

__all__ = ["DraftTree", "Sampling", "make_tree", "validate"]
__version__ = "0.1.0"
