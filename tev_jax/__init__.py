"""tev-jax: tree speculative decoding with Tree Exit Verification in JAX.

The paper's §3 (canonical exit law) is `tev_jax.exit_law`, §4 (exact verifiers, TEV)
is `tev_jax.verify`, DDTree's best-first builder is `tev_jax.ddtree`; draft trees are
`tev_jax.tree.DraftTree`, and the target's sampling transform is `tev_jax.sampling`.
Decoding goes through one object, `tev_jax.engine.Engine` (`Engine.create(target,
drafter, DecodeConfig(...), batch_size)`), or its one-call form `generate`.
(The function `exit_law` is not re-exported here: it would hide the module of that name.)
"""

from tev_jax.decode import DecodeConfig
from tev_jax.engine import Engine, generate, generate_ar
from tev_jax.exit_law import ExitLaw
from tev_jax.generation import Generation
from tev_jax.sampling import Sampling
from tev_jax.tree import DraftTree, make_tree, validate
from tev_jax.verify import Verdict, greedy, predraw, sequential_residual, tev

__all__ = [
    "DecodeConfig", "DraftTree", "Engine", "ExitLaw", "Generation", "Sampling", "Verdict",
    "generate", "generate_ar", "greedy", "make_tree", "predraw", "sequential_residual",
    "tev", "validate",
]
__version__ = "0.1.0"
