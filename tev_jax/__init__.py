"""tev-jax: tree speculative decoding with Tree Exit Verification in JAX.

The paper's §3 (canonical exit law) is `tev_jax.exit_law`, §4 (exact verifiers, TEV)
is `tev_jax.verify`, DDTree's best-first builder is `tev_jax.ddtree`; draft trees are
`tev_jax.tree.DraftTree`, and the target's sampling transform is `tev_jax.sampling`.
Decoding goes through one object, `tev_jax.engine.Engine` (`Engine.create(target,
drafter, DecodeConfig(...), batch_size)`), or its one-call form `generate`.
(The function `exit_law` is not re-exported here: it would hide the module of that name.)
Importing the package first refines Python's default Ctrl-C handler so that an interrupt
is neither dropped in jax's garbage-collector callback nor raised inside a compile
(`tev_jax.exits.refine_default_interrupt`).
"""

from tev_jax.exits import refine_default_interrupt

refine_default_interrupt()  # before jax is imported: its gc callback would drop Ctrl-C

from tev_jax.decode import DecodeConfig  # noqa: E402
from tev_jax.engine import Engine, generate, generate_ar  # noqa: E402
from tev_jax.exit_law import ExitLaw  # noqa: E402
from tev_jax.generation import Generation  # noqa: E402
from tev_jax.sampling import Sampling  # noqa: E402
from tev_jax.tree import DraftTree, make_tree, validate  # noqa: E402
from tev_jax.verify import Verdict, greedy, predraw, sequential_residual, tev  # noqa: E402

__all__ = [
    "DecodeConfig", "DraftTree", "Engine", "ExitLaw", "Generation", "Sampling", "Verdict",
    "generate", "generate_ar", "greedy", "make_tree", "predraw", "sequential_residual",
    "tev", "validate",
]
__version__ = "0.1.0"
