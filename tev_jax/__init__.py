"""tev-jax: tree speculative decoding with Tree Exit Verification in JAX.

The paper's §3 (canonical exit law) is `tev_jax.exit_law`, §4 (exact verifiers, TEV)
is `tev_jax.verify`, DDTree's best-first builder is `tev_jax.ddtree`; draft trees are
`tev_jax.tree.DraftTree`, and the target's sampling transform is `tev_jax.sampling`.
Decoding goes through one object, `tev_jax.engine.Engine` (`Engine.create(target,
drafter, DecodeConfig(...), batch_size)`), or its one-call form `generate`.
(The function `exit_law` is not re-exported here: it would hide the module of that name.)

The names below are imported on first use, so ``import tev_jax`` neither imports jax
nor changes anything in the process (no signal handler, no environment variable): the
command lines start quickly and handle their signals themselves (`tev_jax.runtime.signals`).
"""

import importlib

# name -> the module that defines it
_EXPORTS = {
    "DecodeConfig": "decode", "Engine": "engine", "generate": "engine",
    "generate_ar": "engine", "ExitLaw": "exit_law", "Generation": "generation",
    "Sampling": "sampling", "DraftTree": "tree", "make_tree": "tree", "validate": "tree",
    "Verdict": "verify", "greedy": "verify", "predraw": "verify",
    "sequential_residual": "verify", "tev": "verify",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"tev_jax.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    try:  # a submodule not imported yet: tev_jax.testing, tev_jax.models, ...
        return importlib.import_module(f"tev_jax.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"tev_jax.{name}":
            raise
        raise AttributeError(f"module 'tev_jax' has no attribute {name!r}") from None


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
