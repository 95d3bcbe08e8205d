"""The tree budget from the exit law (docs/design.md §13): ``tev-jax tune`` and ``budget='auto'``.

DDTree trees are nested: the budget-b tree is the first b non-root slots of the
budget-N tree (the builder fills slots in one global order that does not depend on the
budget), and every exact verifier's expected output-block length on a tree is
``1 + sum of P(v)`` over its non-root nodes (`tev_jax.exit_law`). So one decode round
at budget N, at a context, gives the expected block length at every budget b <= N::

    tau_c(b) = 1 + P(slot 1) + ... + P(slot b)

and the distribution of the block length L too (``Pr(L > d)`` = the reach of the first
b slots at depth d). Three steps make the tuning:

1. **Contexts** (`continuations`, `tree_reach`): each prompt plus the target's own
   continuation at the sampling transform (greedy at T = 0), cut at every position a
   decode round can start from; at each, one round at budget N (the engine's own
   prefill, draft, build and verify programs) and the exit law's reach per slot.
2. **τ(b) as decoding visits the contexts** (`tau_curve`): a round that starts at
   position k emits L_k tokens, so the next starts at k + L_k. The block-length laws give
   each position's probability of being a round start (a renewal recursion), and the
   predicted tokens per round is ``sum(visits * tau_k) / sum(visits)``, pooled over
   prompts as `tev_jax.generation.DecodeStats.tau` pools over rows; its standard error
   treats prompts as clusters. (The harmonic mean of ``tau_k`` is the same idea with
   every position visited ``1 / tau_k`` of the time; it is reported too.)
3. **Round costs** t(b, B) (`tev_jax.costs.round_costs`: one-round programs timed on the
   local devices, or a TPU slice's or GPU's compiler) and the **best budget per batch
   size** (`tev_jax.costs.round_costs.best_budgets`): the b that
   maximises ``B * tau(b) / t(b, B)``, or 0 (plain AR, ``B / t_AR(B)``) when nothing
   beats AR.

`tune` runs the three and returns a `Tuning`; ``Tuning.write`` gives the file that
``DecodeConfig(budget='auto', tuning=FILE)`` (``tev-jax generate --budget auto --tuning
FILE``) reads: ``{"tau": {"<b>": τ}, "tau_se": {"<b>": se}, "cost_seconds": {"<B>":
{"<b>": t}}, "ar_seconds": {"<B>": t}, "best": {"<B>": {"budget", "tau",
"tokens_per_second", "speedup"}}, "model": fingerprint, ...}``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tev_jax.runtime import signals
from tev_jax.budget import AutoBudget, model_fingerprint, read_tuning
from tev_jax.decode import DecodeConfig, aligned_len
from tev_jax.drafters import DFlashDrafter, as_drafter
from tev_jax.engine import Engine, as_key
from tev_jax.exit_law import exit_law
from tev_jax.prompts import check_prompts
from tev_jax.costs.round_costs import (Progress, best_budgets, cost_basis, roofline_costs,
    round_costs)
from tev_jax.sampling import Sampling

TUNING_KEYS = ("tau", "tau_se", "cost_seconds", "ar_seconds", "best")
"""The keys of a tuning file that are a contract (`Tuning.as_dict`)."""


def _mesh_scope(mesh):
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def _chunks(items: Sequence, size: int):
    """``items`` in chunks of ``size``, the last padded with its own last item; yields
    (chunk, real count)."""
    for i in range(0, len(items), size):
        part = list(items[i:i + size])
        yield part + [part[-1]] * (size - len(part)), len(part)


# ------------------------------------------------------------------------ contexts


def continuations(target, prompt_ids: Sequence[Sequence[int]], *, max_new_tokens: int,
                  sampling: Sampling = Sampling(temperature=0.0),
                  stop_token_ids: tuple[int, ...] = (), key: jax.Array | int = 0,
                  batch_size: int = 16, mesh=None, progress: Progress | None = None
                  ) -> list[list[int]]:
    """The target's own continuation of every prompt: plain AR decoding at ``sampling``
    (its greedy text at T = 0, a sample at T > 0), at most ``max_new_tokens`` tokens, a
    final stop token included. These are the texts a decode at that sampling visits.

    Args:
      target: the target model.
      prompt_ids: the prompts (token-id lists).
      max_new_tokens: M.
      sampling: the target's sampling transform.
      stop_token_ids: a continuation ends after any of these.
      key: PRNG key or seed (chunk i uses ``fold_in(key, i)``).
      batch_size: prompts decoded together.
      mesh: optional mesh (`tev_jax.engine.Engine.create`).
      progress: called as ``progress("prompts", done, total)`` after each batch.
    """
    prompts = check_prompts(prompt_ids, target.config.vocab_size)
    config = DecodeConfig(max_new_tokens=max_new_tokens, builder="none", sampling=sampling,
                          stop_token_ids=tuple(stop_token_ids),
                          prompt_len=aligned_len(max(len(p) for p in prompts)))
    rows = min(batch_size, len(prompts))
    if progress:  # announced before the first batch compiles
        progress("prompts", 0, len(prompts))
    engine = Engine.create(target, None, config, rows, mesh=mesh)
    key = as_key(key)
    out: list[list[int]] = []
    for i, (chunk, real) in enumerate(_chunks(prompts, rows)):
        signals.check()
        st = engine.generate(engine.prompts(chunk), jax.random.fold_in(key, i))
        out += engine.finish(st).rows()[:real]
        if progress:
            progress("prompts", len(out), len(prompts))
    return out


@dataclasses.dataclass(frozen=True)
class TreeReach:
    """One decode round at budget N at every context: the exit law's reach per slot.

    Context c is prompt ``prompt[c]`` followed by its continuation up to and including
    token ``position[c]``, the round's root (the target has read everything before it).

    Attributes:
      reach: float64 [C, N] the reach P of each slot of the budget-N tree (1 at the
        root, 0 on padding).
      depth: int32 [C, N] each slot's depth (0 at the root and on padding).
      prompt: int [C] the prompt of each context.
      position: int [C] the continuation index k of its root.
      lengths: int [prompts] each continuation's length (the rounds of prompt p start
        at positions 0 .. lengths[p] - 2).
      horizon: H, the drafter's horizon.
    """

    reach: np.ndarray
    depth: np.ndarray
    prompt: np.ndarray
    position: np.ndarray
    lengths: np.ndarray
    horizon: int

    @property
    def budget(self) -> int:
        """N - 1, the largest budget it covers."""
        return self.reach.shape[1] - 1


@functools.lru_cache(maxsize=None)
def _exit_law_jit(sampling: Sampling):
    return jax.jit(jax.vmap(lambda tree, logits: exit_law(tree, logits, sampling)))


def tree_reach(target, drafter, prompt_ids: Sequence[Sequence[int]],
               conts: Sequence[Sequence[int]], *, budget: int,
               sampling: Sampling = Sampling(temperature=0.0), batch_size: int = 16,
               key: jax.Array | int = 0, mesh=None, progress: Progress | None = None
               ) -> TreeReach:
    """The reach of every slot of the budget-``budget`` DDTree at every context.

    Each context is a round exactly as decoding runs it: the engine prefills the tokens
    before the root, the drafter drafts the block from the root, the builder builds the
    tree and the target verifies it (`tev_jax.engine.Engine.stage`); the exit law at
    ``sampling`` gives the reach of each slot.

    Args:
      target, drafter: the models.
      prompt_ids: the prompts; conts: their continuations (`continuations`).
      budget: N - 1, the largest budget of interest.
      sampling: the target's sampling transform (top-k / top-p included).
      batch_size: contexts per program call.
      key: PRNG key or seed (only the prefill's unused first token draws from it).
      mesh: optional mesh.
      progress: called as ``progress("contexts", done, total)`` after each call.
    Raises:
      ValueError: prompts and continuations of different counts, or no context (every
        continuation shorter than 2 tokens).
    """
    if len(prompt_ids) != len(conts):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(conts)} continuations")
    owner, where, before, roots = [], [], [], []
    for p, (prompt, cont) in enumerate(zip(prompt_ids, conts)):
        for k in range(len(cont) - 1):
            owner.append(p)
            where.append(k)
            before.append(list(prompt) + list(cont[:k]))
            roots.append(int(cont[k]))
    if not owner:
        raise ValueError("no context: every continuation has fewer than 2 tokens, so no "
                         "decode round would run (raise max_new_tokens?)")
    rows = min(batch_size, len(owner))
    if progress:  # announced before the first call compiles
        progress("contexts", 0, len(owner))
    config = DecodeConfig(max_new_tokens=2, budget=budget, sampling=sampling,
                          prompt_len=aligned_len(max(len(b) for b in before)))
    engine = Engine.create(target, drafter, config, rows, mesh=mesh)
    draft, build, verify = (engine.stage(s) for s in ("draft", "build", "verify"))
    law_of = _exit_law_jit(sampling)
    key = as_key(key)
    reach, depth = [], []
    pairs = list(zip(before, roots))
    with _mesh_scope(mesh):
        for chunk, real in _chunks(pairs, rows):
            signals.check()
            st = engine.prefill(engine.prompts([b for b, _ in chunk]), key)
            st = st.replace(root_B=jnp.asarray([r for _, r in chunk], jnp.int32))
            draft_BHV, _ = draft(engine.params, st)
            tree = build(draft_BHV, st.root_B)
            logits_BNV = verify(engine.params, st.cache, tree, st.start_B)[0]
            law = law_of(tree, logits_BNV)
            got = jax.device_get((law.reach, tree.depths, tree.valid))
            reach.append(np.where(got[2], got[0], 0.0)[:real])
            depth.append(got[1][:real])
            if progress:
                progress("contexts", sum(len(r) for r in reach), len(pairs))
    return TreeReach(reach=np.concatenate(reach).astype(np.float64),
                     depth=np.concatenate(depth).astype(np.int32),
                     prompt=np.asarray(owner), position=np.asarray(where),
                     lengths=np.asarray([len(c) for c in conts]),
                     horizon=engine.spec.horizon)


# ---------------------------------------------------------------------- tau curves


def tau_per_context(tr: TreeReach) -> np.ndarray:
    """float64 [C, N]: column b is ``1 + C`` of the budget-b tree (b = 0 .. N - 1)."""
    return 1.0 + np.concatenate([np.zeros((len(tr.reach), 1)),
                                 np.cumsum(tr.reach[:, 1:], axis=1)], axis=1)


def block_length_survival(tr: TreeReach) -> np.ndarray:
    """float64 [C, N, H + 1]: ``Pr(L > d)`` for the budget-b tree (axis 1 = b) and
    d = 0 .. H, L the output-block length. Target flow reaches depth d at one node at
    most, so ``Pr(L > d)`` is the reach summed over the first b slots at depth d."""
    at = tr.depth[:, :, None] == np.arange(tr.horizon + 1)[None, None, :]
    at[:, 0, :] = False  # the root
    surv = np.cumsum(tr.reach[:, :, None] * at, axis=1)
    surv[:, :, 0] = 1.0
    return np.minimum(surv, 1.0)


def visit_weights(tr: TreeReach) -> np.ndarray:
    """float64 [C, N]: the probability that a decode at budget b starts a round at each
    context (axis 1 = b), by the renewal recursion over each prompt's positions:
    ``visit[0] = 1``, ``visit[k + l] += visit[k] Pr(L_k = l)``."""
    surv = block_length_survival(tr)
    pmf = surv - np.concatenate([surv[:, :, 1:], np.zeros_like(surv[:, :, :1])], axis=2)
    h1 = tr.horizon + 1
    out = np.zeros(tr.reach.shape)
    for p, n in enumerate(tr.lengths):
        idx = np.flatnonzero(tr.prompt == p)
        if idx.size == 0:
            continue
        order = idx[np.argsort(tr.position[idx])]
        visit = np.zeros((n + h1, tr.reach.shape[1]))
        visit[0] = 1.0
        for c in order:
            k = tr.position[c]
            out[c] = visit[k]
            visit[k + 1: k + 1 + h1] += visit[k][None, :] * pmf[c].T
    return out


@dataclasses.dataclass(frozen=True)
class TauCurve:
    """Predicted tokens per round at each budget b = 0 .. N - 1 (float64 [N] each).

    Attributes:
      tau: what `tev_jax.engine.generate` would measure (``DecodeStats.tau``): tokens
        per round with the contexts weighted as decoding visits them (`visit_weights`),
        pooled over prompts.
      se: its standard error, prompts as clusters (delta method for a ratio).
      harmonic: the harmonic mean of ``tau_c(b)`` over the contexts.
      mean: the plain mean of ``tau_c(b)``.
      prompts, contexts: how many of each it rests on.
    """

    tau: np.ndarray
    se: np.ndarray
    harmonic: np.ndarray
    mean: np.ndarray
    prompts: int
    contexts: int

    def at(self, budget: int) -> tuple[float, float]:
        """(tau, se) at one budget."""
        if not 0 <= budget < len(self.tau):
            raise ValueError(f"budget {budget} is outside the tuned range 0 .. "
                             f"{len(self.tau) - 1}")
        return float(self.tau[budget]), float(self.se[budget])


def tau_curve(tr: TreeReach) -> TauCurve:
    """The predicted tokens per round at every budget up to N - 1 (`TauCurve`)."""
    tau_c = tau_per_context(tr)
    visits = visit_weights(tr)
    prompts = np.unique(tr.prompt)
    tokens = np.stack([np.sum(visits[tr.prompt == p] * tau_c[tr.prompt == p], axis=0)
                       for p in prompts])
    rounds = np.stack([np.sum(visits[tr.prompt == p], axis=0) for p in prompts])
    tau = tokens.sum(0) / rounds.sum(0)
    n = len(prompts)
    resid = tokens - tau[None] * rounds
    se = (np.sqrt(n / (n - 1) * np.sum(resid ** 2, axis=0)) / rounds.sum(0) if n > 1
          else np.full_like(tau, np.nan))
    return TauCurve(tau=tau, se=se, harmonic=1.0 / np.mean(1.0 / tau_c, axis=0),
                    mean=tau_c.mean(0), prompts=n, contexts=len(tr.reach))


# -------------------------------------------------------------------- the tuning file


@dataclasses.dataclass(frozen=True)
class Tuning:
    """A tuning: τ(b), the round costs and the best budget per batch size.

    Attributes:
      tau: budget -> predicted tokens per round (`TauCurve.tau`).
      tau_se: budget -> its standard error.
      cost_seconds: ``[B][b]`` seconds per round; ar_seconds: ``[B]`` per AR step.
      best: `best_budgets`.
      model: the models' fingerprint (`tev_jax.budget.model_fingerprint`).
      settings: how it was made (sampling, M, prompt buffer, prompts, device, ...).
      curve: optional extras (the whole τ curve, harmonic means, ...).
    """

    tau: dict[int, float]
    tau_se: dict[int, float]
    cost_seconds: dict[int, dict[int, float]]
    ar_seconds: dict[int, float]
    best: dict[int, dict[str, float]]
    model: dict[str, Any]
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    curve: dict[str, Any] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict:
        """The JSON form (keys are strings; `TUNING_KEYS` are the contract)."""
        keys = lambda d: {str(k): v for k, v in d.items()}
        return {"tau": keys(self.tau), "tau_se": keys(self.tau_se),
                "cost_seconds": {str(bs): keys(row) for bs, row in self.cost_seconds.items()},
                "ar_seconds": keys(self.ar_seconds),
                "best": {str(bs): dict(v, budget=int(v["budget"]))
                         for bs, v in self.best.items()},
                "model": self.model, "settings": self.settings, "curve": self.curve}

    @classmethod
    def from_dict(cls, d: dict, source: str = "") -> Tuning:
        """The inverse of `as_dict`; a ValueError naming the missing or malformed key."""
        where = source or "the tuning"
        missing = [k for k in (*TUNING_KEYS, "model") if k not in d]
        if missing:
            raise ValueError(f"{where} is not a tuning file: missing {missing}")
        try:
            ints = lambda m: {int(k): v for k, v in m.items()}
            return cls(tau={int(k): float(v) for k, v in d["tau"].items()},
                       tau_se={int(k): float(v) for k, v in d["tau_se"].items()},
                       cost_seconds={int(bs): {int(b): float(t) for b, t in row.items()}
                                     for bs, row in d["cost_seconds"].items()},
                       ar_seconds={int(k): float(v) for k, v in d["ar_seconds"].items()},
                       best=ints(d["best"]), model=dict(d["model"]),
                       settings=dict(d.get("settings") or {}),
                       curve=dict(d.get("curve") or {}))
        except (AttributeError, TypeError, ValueError) as e:
            raise ValueError(f"{where} is not a tuning file: {type(e).__name__}: {e}") from None

    def write(self, path) -> None:
        Path(path).write_text(json.dumps(self.as_dict(), indent=1) + "\n")

    @classmethod
    def read(cls, path) -> Tuning:
        return cls.from_dict(read_tuning(path), source=str(path))

    def auto_budget(self, source: str = "") -> AutoBudget:
        """The `tev_jax.budget.AutoBudget` of ``DecodeConfig(budget=...)``."""
        return AutoBudget.from_tuning(self.as_dict(), source=source)

    def format(self) -> str:
        """A table for people: per batch size, each budget's τ, tokens/s and speed-up."""
        budgets = sorted(self.tau)
        head = f"{'B':>4} {'':>6}" + "".join(f"{b:>10}" for b in budgets) + f"{'AR':>10}  best"
        lines = ["tau(b) " + "  ".join(f"{b}: {self.tau[b]:.3f} ± {self.tau_se[b]:.3f}"
                                        for b in budgets), head]
        for bs in sorted(self.cost_seconds):
            row = self.cost_seconds[bs]
            rate = [bs * self.tau[b] / row[b] for b in budgets] + [bs / self.ar_seconds[bs]]
            best = self.best[bs]
            what = "AR" if best["budget"] == 0 else f"budget {best['budget']}"
            lines.append(f"{bs:>4} {'tok/s':>6}" + "".join(f"{r:10.1f}" for r in rate)
                         + f"  {what} ({best['tokens_per_second']:.1f} tokens/s, "
                           f"{best['speedup']:.2f}x AR)")
            lines.append(f"{'':>4} {'ms':>6}" + "".join(f"{row[b] * 1e3:10.2f}" for b in budgets)
                         + f"{self.ar_seconds[bs] * 1e3:10.2f}")
        return "\n".join(lines)


def tune(target, drafter, prompt_ids: Sequence[Sequence[int]], config: DecodeConfig, *,
         budgets: Sequence[int], batch_sizes: Sequence[int], repeats: int = 10,
         key: jax.Array | int = 0, topology: str | None = None, gpu: str | None = None,
         mesh_axes: tuple[int, int, int] | None = None, dtype=None, mesh=None,
         contexts_batch: int = 16, progress: Progress | None = None) -> Tuning:
    """τ(b) from the exit law, round costs, and the best budget per batch size.

    Args:
      target, drafter: the models.
      prompt_ids: the prompts (token ids): their continuations by the target are the
        contexts (`continuations`, `tree_reach`).
      config: how decoding will run: ``max_new_tokens``, ``sampling`` (T, top-k, top-p),
        ``stop_token_ids``, ``verifier``, ``prompt_len`` (default: the longest prompt).
      budgets: the DDTree budgets to choose among (one exit-law pass at the largest).
      batch_sizes: the batch sizes to tune for.
      repeats: timed passes per program (`round_costs`).
      key: PRNG key or seed.
      topology, gpu: a TPU slice or GPUs ('h200x1'): costs from their compiler
        (`roofline_costs`: on a measured GPU the calibrated estimate) instead of timing
        the local devices.
      mesh_axes, dtype: the slice's mesh and dtype (with ``topology`` or ``gpu``).
      mesh: a local mesh for the τ pass and the timed costs.
      contexts_batch: contexts per program call in the τ pass.
      progress: ``progress(what, done, total)`` as prompts, contexts and budget programs
        get done (`continuations`, `tree_reach`, `round_costs`).
    Returns:
      The `Tuning`.
    """
    budgets = sorted({int(b) for b in budgets})
    batch_sizes = sorted({int(b) for b in batch_sizes})
    if not budgets or budgets[0] < 1 or not batch_sizes or batch_sizes[0] < 1:
        raise ValueError(f"budgets and batch sizes must be positive ints, got {budgets}, "
                         f"{batch_sizes}")
    prompts = check_prompts(prompt_ids, target.config.vocab_size, config.prompt_len)
    key = as_key(key)
    t0 = time.perf_counter()
    conts = continuations(target, prompts, max_new_tokens=config.max_new_tokens,
                          sampling=config.sampling, stop_token_ids=config.stop_token_ids,
                          key=jax.random.fold_in(key, 1), batch_size=contexts_batch,
                          mesh=mesh, progress=progress)
    tr = tree_reach(target, drafter, prompts, conts, budget=budgets[-1],
                    sampling=config.sampling, batch_size=contexts_batch, mesh=mesh,
                    progress=progress)
    curve = tau_curve(tr)
    tau_seconds = time.perf_counter() - t0
    width = config.prompt_len or aligned_len(max(len(p) for p in prompts))
    config = dataclasses.replace(config, prompt_len=width, tuning=None,
                                 budget=budgets[0] if isinstance(config.budget, AutoBudget)
                                 else config.budget)
    if topology is None and gpu is None:
        cost, ar = round_costs(target, drafter, prompts, config, budgets, batch_sizes,
                               repeats=repeats, key=key, mesh=mesh, progress=progress)
        device = f"local {jax.devices()[0].device_kind}"
    else:
        cost, ar = roofline_costs(target.config, config, budgets, batch_sizes,
                                  topology=topology, gpu=gpu, mesh_axes=mesh_axes,
                                  dtype=dtype or jnp.bfloat16,
                                  drafter_layers=_drafter_layers(drafter),
                                  block_size=tr.horizon + 1)
        device = f"{cost_basis(gpu)} of {topology or gpu}"
    tau = {b: curve.at(b)[0] for b in budgets}
    s = config.sampling
    return Tuning(
        tau=tau, tau_se={b: curve.at(b)[1] for b in budgets}, cost_seconds=cost,
        ar_seconds=ar, best=best_budgets(tau, cost, ar),
        model=model_fingerprint(target, drafter),
        settings={"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
                  "max_new_tokens": config.max_new_tokens, "prompt_len": width,
                  "verifier": config.verifier if isinstance(config.verifier, str) else None,
                  "prompts": len(prompts), "contexts": curve.contexts, "repeats": repeats,
                  "device": device, "tau_seconds": round(tau_seconds, 1)},
        curve={"budget": list(range(len(curve.tau))), "tau": curve.tau.tolist(),
               "tau_se": curve.se.tolist(), "harmonic": curve.harmonic.tolist(),
               "mean": curve.mean.tolist()})


def _drafter_layers(drafter) -> int:
    d = as_drafter(drafter)
    return d.drafter.config.num_layers if isinstance(d, DFlashDrafter) else 1


def plot(tuning: Tuning, path) -> None:
    """A figure (needs the ``plots`` extra): τ(b) with its band, and tokens/s against
    the budget per batch size with AR as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = sorted(tuning.tau)
    fig, (ax_tau, ax_rate) = plt.subplots(1, 2, figsize=(10, 4))
    if tuning.curve.get("tau"):
        b_all = np.asarray(tuning.curve["budget"][1:])
        tau_all = np.asarray(tuning.curve["tau"][1:])
        se_all = np.asarray(tuning.curve["tau_se"][1:])
        ax_tau.plot(b_all, tau_all, color="C0", label="exit law, as decoding visits")
        ax_tau.fill_between(b_all, tau_all - 2 * se_all, tau_all + 2 * se_all, color="C0",
                            alpha=0.2)
    ax_tau.errorbar(budgets, [tuning.tau[b] for b in budgets],
                    yerr=[2 * tuning.tau_se[b] for b in budgets], fmt="o", color="C0")
    ax_tau.set(xscale="log", xlabel="budget b", ylabel="τ(b), tokens per round")
    ax_tau.legend(loc="lower right")
    for i, bs in enumerate(sorted(tuning.cost_seconds)):
        row = tuning.cost_seconds[bs]
        rate = [bs * tuning.tau[b] / row[b] for b in budgets]
        ax_rate.plot(budgets, rate, "o-", color=f"C{i + 1}", label=f"B = {bs}")
        ax_rate.axhline(bs / tuning.ar_seconds[bs], color=f"C{i + 1}", ls="--", lw=1)
    ax_rate.set(xscale="log", yscale="log", xlabel="budget b",
                ylabel="tokens/s (dashed: AR)")
    ax_rate.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["TUNING_KEYS", "TauCurve", "TreeReach", "Tuning", "best_budgets",
           "block_length_survival", "continuations", "cost_basis", "plot", "round_costs",
           "roofline_costs", "tau_curve", "tau_per_context", "tree_reach", "tune",
           "visit_weights"]
