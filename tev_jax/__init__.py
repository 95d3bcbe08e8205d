"""tev-jax: tree speculative decoding with Tree Exit Verification in JAX.

The root is the method, in the paper's order: draft trees (`tev_jax.tree`), DDTree's
best-first builder (`tev_jax.ddtree`), the canonical exit law (§3, `tev_jax.exit_law`),
the exact verifiers and TEV (§4, `tev_jax.verify`) over the vocabulary's reductions
(`tev_jax.vocab`) and the target's sampling transform (`tev_jax.sampling`), the
extension points (`tev_jax.extensions`), drafters (`tev_jax.drafters`), the decode round
and its engine (`tev_jax.decode`, `tev_jax.engine`: `Engine.create(target, drafter,
DecodeConfig(...), batch_size)`, or the one-call `generate`), row slots for continuous
batching (`tev_jax.slots`), and ExitTrain's objectives (§5, `tev_jax.exit_train`). The
wings: `tev_jax.costs` (plans, tuning, timing), `tev_jax.batch` (the prompts-file job),
`tev_jax.server` (``tev-jax serve``), `tev_jax.runtime` (platforms, signals, exit codes),
`tev_jax.models`, `tev_jax.kernels`, `tev_jax.cli`; docs/design.md §10 has the layout.
(The function `exit_law` is not re-exported here: it would hide the module of that name.)

The names below are imported on first use, so ``import tev_jax`` neither imports jax
nor changes anything in the process (no signal handler, no environment variable): the
command lines start quickly and handle their signals themselves
(`tev_jax.runtime.signals`).
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
