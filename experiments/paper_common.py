"""Shared code of the paper-reproduction studies (issue 8).

One module for what the studies under ``experiments/`` (main_table, ablation, fixed_tree,
verifier_stage, budget, figures) have in common:

- **models**: the trained target (Hugging Face layout) and the named DFlash drafters
  ``<drafters>/<name>/drafter`` (`load_models`; `MAKE_MODELS` trains them into ``runs/``,
  and without them the bundled target and drafters stand in, `study_model_dirs`), or a
  tiny random pair for smoke runs and tests (`make_random_models`);
- **prompts**: the four evaluation sets, a fixed evenly spaced selection of prompts
  from each, left-truncated to ``prompt_len`` tokens (`eval_prompts`);
- **runs**: every generation goes through the fused engine of `tev_jax.decode` (the
  whole generation is one jitted ``lax.while_loop``). `FusedRunner` compiles one
  configuration once for a fixed batch and prompt buffer length, so every prompt and
  every drafter of the same architecture reuse that compilation (`tau_runs`: batched,
  τ only; `timed_runs`: batch 1, τ and speed-up over AR measured in the same process);
- **real trees**: the draft tree and the target's logits of one decode round at given
  contexts (`capture_trees`), for the fixed-tree and verifier-stage studies and the
  figures;
- **tables and outputs**: markdown tables, results JSON, and the README block between
  ``<!-- results:begin -->`` and ``<!-- results:end -->`` (`write_outputs`).

Definitions used in every table:

- τ (tau): mean output-block length per target verify round = accepted draft tokens +
  the bonus token, pooled over the rounds of all prompts of a set (``sum of block
  lengths / number of rounds``, `tev_jax.generation.DecodeStats.tau`). The first token,
  sampled from the prefill's logits, is not a round and is not counted. A block that
  crosses ``max_new_tokens`` or a stop token counts in full. AR has τ = 1. Its standard
  error treats prompts as independent clusters (`ratio_se`), not rounds.
- SR: tokens/s of a method divided by tokens/s of autoregressive decoding (AR, the same
  target through the same engine with ``builder='none'``), both timed batch 1 in the
  same process; tokens/s of a set = its generated tokens / the sum of its per-prompt
  times (median of ``repeats``). Averages are the mean of the four per-set values.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tev_jax import ddtree, decode, drafters
from tev_jax.engine import Engine
from tev_jax import verify as verify_lib
from tev_jax.data import PROMPT_SETS, load_default_tokenizer, prompt_set
from tev_jax.exit_law import exit_law
from tev_jax.generation import DecodeStats, Generation
from tev_jax.models import kv_cache as kvc
from tev_jax.models import load_drafter, load_target, load_tokenizer
from tev_jax.sampling import Sampling
from tev_jax.tree import DraftTree, ancestor_mask

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TARGET = REPO / "runs" / "target" / "hf"
DEFAULT_DRAFTERS = REPO / "runs" / "drafters"
DEFAULT_COMPILE_CACHE = REPO / "runs" / "jax_cache"

SETS: tuple[str, ...] = PROMPT_SETS  # mt_bench, humaneval, gsm, math
SET_LABELS = {"mt_bench": "dialogue", "humaneval": "code", "gsm": "math",
              "math": "comp. math"}
DRAFTER_NAMES = ("dflash", "ft_exit", "ft_token", "ft_prefix", "ft_exit_depth")
DRAFTER_LABELS = {
    "dflash": "DFlash (token objective, DDTree's drafter)",
    "ft_token": "token-only fine-tune",
    "ft_prefix": "prefix (reach P) weighting",
    "ft_exit": "exit weighting (ExitTrain)",
    "ft_exit_depth": "exit x depth weighting",
}
BUNDLED_AS = {"dflash": "dflash", "ft_exit": "exittrain"}
"""The study drafters the package ships (`tev_jax.models.bundled`), study name -> bundled
name: DFlash, and its ExitTrain fine-tune (`experiments/exit_recipe`'s choice)."""
MAKE_MODELS = "python -m train.demo.build"
"""Trains the studies' target and all five drafters into ``runs/`` (`DEFAULT_TARGET`)."""
FIELD_LABELS = {"tau": "τ", "sr": "SR", "tau_exit_law": "1+C", "tau_se": "±"}
_ALIGN = 8  # the engine's length alignment


# ------------------------------------------------------------------------- methods


@dataclasses.dataclass(frozen=True)
class Method:
    """A decoding method: a drafter (by name) + DDTree budget + verifier, or plain AR.

    Attributes:
      label: row name in the tables.
      drafter: drafter name under the drafter root, or None for autoregressive decoding.
      verifier: 'tev', 'predraw', ... (`tev_jax.extensions.VERIFIERS`).
      budget: DDTree node budget B (N = B + 1 tree slots).
    """

    label: str
    drafter: str | None = None
    verifier: str = "tev"
    budget: int = 64

    def config(self, sampling: Sampling, setup: "Setup", *, track_exit_law: bool = False,
               stop_ids: tuple[int, ...] = ()) -> decode.DecodeConfig:
        """The `DecodeConfig` of this method (prompt buffer, hence cache length, fixed by
        the setup)."""
        builder = "none" if self.drafter is None else "ddtree"
        return decode.DecodeConfig(
            max_new_tokens=setup.max_new_tokens, builder=builder, budget=self.budget,
            verifier=self.verifier, sampling=sampling, stop_token_ids=stop_ids,
            prompt_len=setup.prompt_len,
            track_exit_law=track_exit_law and self.drafter is not None)


AR = Method("AR")


def ddtree_method(budget: int = 64) -> Method:
    """DDTree: the DFlash drafter + predraw-and-follow (the paper's baseline)."""
    return Method("DDTree", "dflash", "predraw", budget)


def exittrain_method(budget: int = 64) -> Method:
    """ExitTrain + TEV: the exit-weighted fine-tune verified by TEV (the paper's method)."""
    return Method("ExitTrain + TEV", "ft_exit", "tev", budget)


# --------------------------------------------------------------------------- setup


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every study run shares (recorded in its results JSON).

    Attributes:
      prompts_per_set: prompts taken from each set (evenly spaced over the set).
      max_new_tokens: M, generated tokens per prompt (the prefill's token included).
      prompt_len: P, the prompt buffer; longer prompts keep BOS and their last P - 1
        tokens. Fixing P lets every prompt share one compilation.
      temperatures: target sampling temperatures.
      seed: PRNG seed (prompt i of a set uses ``seed * 1000 + i``).
      repeats: timed runs per prompt and method (median).
      sets: evaluation sets.
      stop: stop at the chat end / end-of-text tokens.
    """

    prompts_per_set: int = 8
    max_new_tokens: int = 96
    prompt_len: int = 128
    temperatures: tuple[float, ...] = (0.0, 1.0)
    seed: int = 0
    repeats: int = 1
    sets: tuple[str, ...] = SETS
    stop: bool = True


def add_arguments(ap: argparse.ArgumentParser, *, prompts: int = 8, max_new_tokens: int = 96,
                  repeats: int = 1) -> argparse.ArgumentParser:
    """The command-line flags every study shares (defaults = the study's full run)."""
    ap.add_argument("--target", default=str(DEFAULT_TARGET),
                    help="target checkpoint directory (Hugging Face layout; default: the "
                    f"one `{MAKE_MODELS}` trains, else the bundled target)")
    ap.add_argument("--drafters", default=str(DEFAULT_DRAFTERS),
                    help="folder holding <name>/drafter for each drafter (default: the "
                    f"ones `{MAKE_MODELS}` trains, else the bundled {'/'.join(BUNDLED_AS)})")
    ap.add_argument("--random-models", action="store_true",
                    help="use a tiny random target/drafter pair (smoke runs, no README update)")
    ap.add_argument("--quick", action="store_true",
                    help="2 prompts per set, 32 new tokens -> results_quick.json")
    ap.add_argument("--prompts", type=int, default=prompts, help="prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--sets", nargs="+", default=list(SETS), choices=list(SETS))
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-stop", action="store_true", help="ignore stop tokens")
    ap.add_argument("--out", default=None, help="results JSON path")
    ap.add_argument("--no-compile-cache", action="store_true",
                    help=f"do not use the persistent compilation cache ({DEFAULT_COMPILE_CACHE})")
    return ap


def setup_from_args(args: argparse.Namespace) -> Setup:
    """A `Setup` from the shared flags (``--quick``: 2 prompts, 32 new tokens, 1 repeat)."""
    if args.quick:
        prompts, max_new, repeats = min(args.prompts, 2), min(args.max_new_tokens, 32), 1
    else:
        prompts, max_new, repeats = args.prompts, args.max_new_tokens, args.repeats
    if prompts < 1 or max_new < 2 or repeats < 1 or args.prompt_len < 2:
        raise ValueError("--prompts and --repeats must be >= 1, --max-new-tokens and "
                         "--prompt-len >= 2")
    return Setup(prompts_per_set=prompts, max_new_tokens=max_new,
                 prompt_len=args.prompt_len, temperatures=tuple(args.temperatures),
                 seed=args.seed, repeats=repeats, sets=tuple(args.sets),
                 stop=not args.no_stop)


def enable_compile_cache(args: argparse.Namespace | None = None) -> None:
    """Persistent XLA compilation cache shared by the studies (same configs compile once)."""
    if args is not None and args.no_compile_cache:
        return
    DEFAULT_COMPILE_CACHE.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(DEFAULT_COMPILE_CACHE))


# -------------------------------------------------------------------------- models


@dataclasses.dataclass
class Models:
    """The target, its tokenizer and the named drafters (all loaded in float32)."""

    target: Any
    tokenizer: Any
    drafters: dict[str, Any]
    source: dict[str, str]

    @property
    def stop_ids(self) -> tuple[int, ...]:
        ids = (self.tokenizer.token_to_id(t) for t in ("<|end|>", "<|eos|>"))
        return tuple(int(i) for i in ids if i is not None)

    def describe(self) -> dict:
        t = self.target.config
        d = next(iter(self.drafters.values()), None)
        return dict(source=self.source, target_params=t.num_params, vocab=t.vocab_size,
                    target_layers=t.num_layers, hidden=t.hidden_size,
                    drafter_layers=None if d is None else d.config.num_layers,
                    block_size=None if d is None else d.config.block_size)


def load_study(name: str):
    """Another study's ``experiments/<name>/run.py`` as a module (``<name>_study``), for
    the study that builds on its stages."""
    spec = importlib.util.spec_from_file_location(f"{name}_study", REPO / "experiments" / name
                                                  / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def flags(args: dict) -> list[str]:
    """``{"lr": "1e-4", "num_anchors": 8}`` -> ``["--lr", "1e-4", "--num-anchors", "8"]``."""
    return [x for k, v in args.items() for x in ("--" + k.replace("_", "-"), str(v))]


def run_train(argv: Sequence[str], log: Path, study: str) -> None:
    """``python -m train ARGV`` from the repository root, logged to ``log`` (a run
    resumes from its checkpoints); a failure stops the ``study``."""
    print(f"[{study}] python -m train {' '.join(map(str, argv))}", flush=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(log, "a") as out:
        code = subprocess.call([sys.executable, "-m", "train", *map(str, argv)], cwd=REPO,
                               env=env, stdout=out, stderr=subprocess.STDOUT)
    if code:
        raise SystemExit(f"python -m train {argv[0]} failed (exit {code}; see {log})")


def drafter_dir(root: str | os.PathLike, name: str) -> Path:
    return Path(root) / name / "drafter"


def load_models(target_dir: str | os.PathLike, drafter_root: str | os.PathLike,
                names: Iterable[str]) -> Models:
    """Loads the target and the drafters ``<drafter_root>/<name>/drafter``.

    Raises:
      ValueError: a missing target or drafter directory (named in the message).
    """
    return load_model_dirs(target_dir, {n: drafter_dir(drafter_root, n) for n in names})


def load_model_dirs(target_dir: str | os.PathLike, drafter_dirs: dict[str, Path]) -> Models:
    """Loads the target and each named drafter from its directory.

    Raises:
      ValueError: a missing target or drafter directory (named in the message).
    """
    target_dir = Path(target_dir)
    if not (target_dir / "config.json").is_file():
        raise ValueError(f"no target checkpoint at {target_dir} (config.json missing); "
                         "pass --target DIR or --random-models")
    target = load_target(target_dir)
    tokenizer = (load_tokenizer(target_dir) if (target_dir / "tokenizer.json").is_file()
                 else load_default_tokenizer())
    drafters, source = {}, {"target": str(target_dir)}
    for name, path in drafter_dirs.items():
        if not (Path(path) / "config.json").is_file():
            raise ValueError(f"no drafter {name!r} at {path}; pass --drafters ROOT")
        drafters[name] = load_drafter(path, target)
        source[name] = str(path)
    return Models(target, tokenizer, drafters, source)


def study_model_dirs(target: str | os.PathLike, drafter_root: str | os.PathLike,
                     names: Iterable[str], *, trained_target: Path = DEFAULT_TARGET,
                     trained_drafters: Path = DEFAULT_DRAFTERS
                     ) -> tuple[Path, dict[str, Path]]:
    """Where a study's models are: ``--target`` and ``<--drafters>/<name>/drafter``, or,
    where both flags keep their defaults and `MAKE_MODELS` has not trained a target
    there (a fresh clone), the bundled target and its drafters (`BUNDLED_AS`).

    Returns:
      (target directory, {drafter name: directory}).
    Raises:
      ValueError: on the bundled models, a drafter the package does not ship (the
        message names the command that trains it).
    """
    names = tuple(names)
    defaults = (Path(target) == Path(trained_target)
                and Path(drafter_root) == Path(trained_drafters))
    if not defaults or (Path(trained_target) / "config.json").is_file():
        return Path(target), {n: drafter_dir(drafter_root, n) for n in names}
    missing = [n for n in names if n not in BUNDLED_AS]
    if missing:
        raise ValueError(
            f"no drafter{'s' * (len(missing) > 1)} {', '.join(missing)} in {trained_drafters}"
            f": `{MAKE_MODELS}` trains them (the package bundles only "
            f"{', '.join(BUNDLED_AS)}), or pass --target DIR --drafters ROOT or "
            "--random-models")
    from tev_jax.models import bundled_paths

    paths = bundled_paths(drafters=tuple(BUNDLED_AS[n] for n in names))
    return paths.target, {n: paths.drafters[BUNDLED_AS[n]] for n in names}


def make_random_models(root: str | os.PathLike, names: Iterable[str] = DRAFTER_NAMES, *,
                       hidden: int = 32, layers: int = 2, block_size: int = 4,
                       head_scale: float = 10.0) -> tuple[Path, Path]:
    """Writes a tiny random target (V = 4096, the bundled tokenizer) and drafters.

    The LM head is scaled by ``head_scale`` so that next-token distributions are peaked
    (a random head gives near-uniform ones). Returns ``(target_dir, drafter_root)``.
    """
    from tev_jax.data import MASK_ID
    from tev_jax.models import ModelConfig, init_drafter, init_target, save_drafter, save_target

    root = Path(root)
    tokenizer = load_default_tokenizer()
    cfg = ModelConfig(model_type="qwen3", vocab_size=tokenizer.get_vocab_size(),
                      hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
                      num_heads=4, num_kv_heads=2, head_dim=hidden // 4, qk_norm=True,
                      max_position_embeddings=2048)
    target = init_target(cfg, key=0)
    target.lm_head[...] = target.lm_head[...] * head_scale
    target_dir = root / "target" / "hf"
    save_target(target, target_dir, tokenizer=tokenizer)
    for i, name in enumerate(names):
        d = init_drafter(target, num_layers=1, block_size=block_size, mask_token_id=MASK_ID,
                         key=1 + i)
        save_drafter(d, drafter_dir(root / "drafters", name))
    return target_dir, root / "drafters"


def models_from_args(args: argparse.Namespace, names: Iterable[str]) -> Models:
    """The study's models (`study_model_dirs` of ``--target/--drafters``), or a fresh
    random pair."""
    names = tuple(names)
    if args.random_models:
        import tempfile

        root = Path(tempfile.mkdtemp(prefix="tev_paper_random_"))
        target_dir, drafter_root = make_random_models(root, names)
        models = load_models(target_dir, drafter_root, names)
        models.source["random"] = "tiny random pair (make_random_models)"
        return models
    return load_model_dirs(*study_model_dirs(args.target, args.drafters, names))


# ------------------------------------------------------------------------- prompts


def select_indices(total: int, n: int) -> list[int]:
    """``n`` evenly spaced indices of ``range(total)`` (first and last included)."""
    if n >= total:
        return list(range(total))
    return sorted({int(round(x)) for x in np.linspace(0, total - 1, n)})


def truncate(ids: Sequence[int], length: int) -> list[int]:
    """Keeps the first token (BOS) and the last ``length - 1`` tokens of a long prompt."""
    ids = list(ids)
    return ids if len(ids) <= length else ids[:1] + ids[len(ids) - length + 1:]


def eval_prompts(tokenizer, setup: Setup) -> dict[str, list[list[int]]]:
    """Token ids of the selected prompts of every set (BOS first, at most P tokens)."""
    out = {}
    for name in setup.sets:
        texts = prompt_set(name)
        out[name] = [truncate(tokenizer.encode(texts[i]).ids, setup.prompt_len)
                     for i in select_indices(len(texts), setup.prompts_per_set)]
    return out


# ---------------------------------------------------------------------------- runs


class FusedRunner:
    """The fused generation of one configuration, compiled once for a batch size and a
    prompt buffer of ``prompt_len`` slots; any drafter of the same architecture reuses it.

    The configuration's ``prompt_len`` fixes the prompt buffer (and so the cache
    length). Unlike `tev_jax.engine.generate`, the runner keeps one
    `tev_jax.engine.Engine` per drafter (`models_for`, same compilation) and times only
    the jitted call.
    """

    def __init__(self, target, drafter, config: decode.DecodeConfig, batch: int):
        if config.prompt_len is None:
            raise ValueError("FusedRunner needs a config with a fixed prompt_len")
        self.config, self.batch, self.prompt_len = config, batch, config.prompt_len
        self.engine = Engine.create(target, drafter, config, batch)
        self.compile_seconds = None

    def models_for(self, target, drafter) -> Engine:
        """The runner's engine over ``(target, drafter)`` (same architecture)."""
        return self.engine.with_models(target, drafter)

    def __call__(self, models: Engine, prompts, key) -> Generation:
        """One generation; ``stats.seconds`` = wall time of the jitted call."""
        inputs = models.prompts(prompts)
        if isinstance(key, int):
            key = jax.random.key(key)
        t0 = time.perf_counter()
        st = jax.block_until_ready(models.generate(inputs, key))
        seconds = time.perf_counter() - t0
        if self.compile_seconds is None:
            self.compile_seconds = seconds
        return models.finish(st, seconds=seconds)

    def compile(self, models: Engine) -> float:
        """Compiles (first call on a dummy batch); returns the seconds it took."""
        if self.compile_seconds is None:
            self(models, [[1, 2]] * self.batch, jax.random.key(0))
        return self.compile_seconds


class RunnerPool:
    """Compiled runners by (configuration, batch) and their engines by drafter."""

    def __init__(self, models: Models, setup: Setup):
        self.models, self.setup = models, setup
        self._runners: dict = {}
        self._engines: dict = {}

    def get(self, method: Method, sampling: Sampling, batch: int, *,
            track_exit_law: bool = False):
        """(runner, params) for ``method``; compiles on first use (printed)."""
        stop = self.models.stop_ids if self.setup.stop else ()
        cfg = method.config(sampling, self.setup, track_exit_law=track_exit_law,
                            stop_ids=stop)
        drafter = None if method.drafter is None else self.models.drafters[method.drafter]
        key = (cfg, batch)
        if key not in self._runners:
            runner = FusedRunner(self.models.target, drafter, cfg, batch)
            params = self._engine_of(runner, method)
            secs = runner.compile(params)
            what = f"{method.verifier} B={method.budget}" if method.drafter else "AR"
            print(f"  compiled {what} T={sampling.temperature} batch={batch}: {secs:.1f} s",
                  flush=True)
            self._runners[key] = runner
        runner = self._runners[key]
        return runner, self._engine_of(runner, method)

    def _engine_of(self, runner: FusedRunner, method: Method):
        key = (id(runner), method.drafter)  # runners live as long as the pool
        if key not in self._engines:
            d = None if method.drafter is None else self.models.drafters[method.drafter]
            self._engines[key] = runner.models_for(self.models.target, d)
        return self._engines[key]

    def compile_seconds(self) -> list[float]:
        return [r.compile_seconds for r in self._runners.values()]


def _row_blocks(stats: DecodeStats, row: int) -> np.ndarray:
    return stats.block_lengths[: int(stats.rounds_per_row[row]), row]


def _ratio_influence(num_i, den_i) -> np.ndarray:
    """Per-cluster linearisation of ``sum(num) / sum(den)`` (delta method)."""
    num, den = np.asarray(num_i, np.float64), np.asarray(den_i, np.float64)
    total = max(den.sum(), 1e-300)
    return (num - num.sum() / total * den) / total


def _cluster_se(z: np.ndarray) -> float:
    n = z.size
    return float(np.sqrt(n / (n - 1) * np.sum(z ** 2))) if n > 1 else 0.0


def ratio_se(num_i: Sequence[float], den_i: Sequence[float]) -> float:
    """Standard error of ``sum(num) / sum(den)`` with the items (prompts) as independent
    clusters (delta method). Rounds of one generation are not independent (a prompt
    whose continuation repeats itself has long blocks in every round), so τ's error is
    taken over prompts, not rounds."""
    return _cluster_se(_ratio_influence(num_i, den_i))


def paired_diff_se(a: dict, b: dict) -> float:
    """Standard error of ``a['tau'] - b['tau']`` for two records over the same prompts
    (paired clusters: what the two runs share per prompt cancels; 0 if they agree on
    every prompt, e.g. two exact verifiers at T = 0)."""
    za, zb = (_ratio_influence(r["prompt_block_sums"], r["prompt_rounds"]) for r in (a, b))
    return _cluster_se(za - zb)


def _set_record(method: Method, temperature: float, set_name: str, blocks: list[np.ndarray],
                tokens: int, **extra) -> dict:
    """τ, its standard error over prompts (`ratio_se`) and the raw per-prompt counts."""
    b = np.concatenate(blocks) if blocks else np.zeros(0)
    n = int(b.size)
    sums, rounds = [int(x.sum()) for x in blocks], [int(x.size) for x in blocks]
    return dict(method=method.label, drafter=method.drafter, verifier=method.verifier,
                budget=method.budget, temperature=temperature, set=set_name,
                prompts=len(blocks), rounds=n, block_sum=int(b.sum()), tokens=int(tokens),
                tau=float(b.mean()) if n else 1.0, tau_se=ratio_se(sums, rounds),
                prompt_block_sums=sums, prompt_rounds=rounds, **extra)


def tau_runs(models: Models, methods: Sequence[Method], prompts: dict[str, list[list[int]]],
             setup: Setup, *, track_exit_law: bool = True, pool: RunnerPool | None = None
             ) -> list[dict]:
    """τ of every method on every set and temperature; each set is one batched call.

    With ``track_exit_law`` each record also has ``tau_exit_law``: the mean over rounds
    of the exit law's ``1 + coverage`` of the verified tree (the expectation of the block
    length given the tree; a lower-variance estimate of the same τ).
    """
    pool = pool or RunnerPool(models, setup)
    records = []
    for temp in setup.temperatures:
        sampling = Sampling(temperature=temp)
        for method in methods:
            for set_name, ps in prompts.items():
                runner, params = pool.get(method, sampling, len(ps),
                                          track_exit_law=track_exit_law)
                gen = runner(params, ps, jax.random.key(setup.seed))
                st = gen.stats
                blocks = [_row_blocks(st, b) for b in range(len(ps))]
                extra = {}
                if st.expected_lengths is not None:
                    exp = np.concatenate([st.expected_lengths[: int(st.rounds_per_row[b]), b]
                                          for b in range(len(ps))])
                    extra["tau_exit_law"] = float(exp.mean()) if exp.size else 1.0
                    extra["tau_exit_law_se"] = (float(exp.std(ddof=1) / np.sqrt(exp.size))
                                                if exp.size > 1 else 0.0)
                rec = _set_record(method, temp, set_name, blocks, int(gen.lengths.sum()),
                                  seconds_batched=st.seconds, **extra)
                records.append(rec)
                print(f"T={temp} {method.label:28s} {set_name:10s} tau {rec['tau']:.3f}"
                      f" ± {rec['tau_se']:.3f} (SE over prompts; {rec['rounds']} rounds)",
                      flush=True)
    return records


def timed_runs(models: Models, methods: Sequence[Method], prompts: dict[str, list[list[int]]],
               setup: Setup, *, pool: RunnerPool | None = None) -> list[dict]:
    """τ and SR of every method, batch 1, every prompt timed ``repeats`` times.

    ``methods`` must include `AR` (the SR reference). All configurations of a temperature
    are compiled first; then, prompt by prompt, the methods run in a rotated order (so
    that load drift hits them alike) and the median time per prompt is kept. Each record
    also says whether the method's tokens equal AR's on every prompt (``matches_ar``:
    must hold at T = 0, where every exact verifier follows the target's argmax).
    """
    methods = list(methods)
    if AR not in methods:
        raise ValueError("timed_runs needs the AR method (the SR reference)")
    pool = pool or RunnerPool(models, setup)
    records = []
    for temp in setup.temperatures:
        sampling = Sampling(temperature=temp)
        for m in methods:
            pool.get(m, sampling, 1)
        for set_name, ps in prompts.items():
            acc = {m: dict(blocks=[], seconds=0.0, tokens=0, outputs=[]) for m in methods}
            for i, p in enumerate(ps):
                order = methods[i % len(methods):] + methods[: i % len(methods)]
                times = {m: [] for m in methods}
                last = {}
                for _ in range(setup.repeats):
                    for m in order:
                        runner, params = pool.get(m, sampling, 1)
                        last[m] = runner(params, [p], jax.random.key(setup.seed * 1000 + i))
                        times[m].append(last[m].stats.seconds)
                for m in methods:
                    a, gen = acc[m], last[m]
                    a["blocks"].append(_row_blocks(gen.stats, 0))
                    a["seconds"] += float(np.median(times[m]))
                    a["tokens"] += int(gen.lengths[0])
                    a["outputs"].append(gen.rows()[0])
            ar = acc[AR]
            ar_speed = ar["tokens"] / ar["seconds"]
            for m in methods:
                a = acc[m]
                speed = a["tokens"] / a["seconds"]
                rec = _set_record(m, temp, set_name, a["blocks"], a["tokens"],
                                  seconds=a["seconds"], tokens_per_s=speed,
                                  sr=speed / ar_speed,
                                  matches_ar=a["outputs"] == ar["outputs"])
                records.append(rec)
                print(f"T={temp} {m.label:16s} B={m.budget if m.drafter else '-':<4} "
                      f"{set_name:10s} "
                      f"tau {rec['tau']:.3f}  {speed:8.1f} tok/s  SR {rec['sr']:.3f}"
                      f"  same tokens as AR: {rec['matches_ar']}", flush=True)
    return records


# -------------------------------------------------------------------------- tables


def select(records: Iterable[dict], **match) -> list[dict]:
    """The records whose fields equal ``match``."""
    return [r for r in records if all(r.get(k) == v for k, v in match.items())]


def one(records: Iterable[dict], **match) -> dict:
    found = select(records, **match)
    if len(found) != 1:
        raise ValueError(f"expected one record for {match}, found {len(found)}")
    return found[0]


def set_average(records: Iterable[dict], field: str, sets: Sequence[str], **match) -> float:
    """Mean of ``field`` over the sets (each set weighs the same, as in the paper)."""
    return float(np.mean([one(records, set=s, **match)[field] for s in sets]))


def markdown(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table; floats are printed with 2 decimals, 3 below 1."""
    def cell(x):
        if isinstance(x, float):
            return f"{x:.3f}" if abs(x) < 1 else f"{x:.2f}"
        return str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def per_set_table(records: Sequence[dict], labels: Sequence[str], temperature: float,
                  fields: Sequence[str], sets: Sequence[str], *, key: str = "method",
                  ratio_rows: Sequence[tuple[str, str]] = (),
                  delta_rows: Sequence[tuple[str, str]] = (), **match) -> str:
    """Rows = methods (``records[key]`` in ``labels``), columns = each set's ``fields``
    then their averages over the sets; ``ratio_rows`` adds ``a / b`` rows and
    ``delta_rows`` adds ``a - b`` rows of τ with its standard error over prompts, paired
    by prompt (`paired_diff_se`; the average's error combines the sets')."""
    name = lambda f: FIELD_LABELS.get(f, f)
    header = ["method"] + [f"{SET_LABELS.get(s, s)} {name(f)}" for s in sets
                           for f in fields] + [f"avg {name(f)}" for f in fields]
    rows = []

    def sel(label):
        return dict(match, temperature=temperature, **{key: label})

    def values(label):
        return ([one(records, set=s, **sel(label))[f] for s in sets for f in fields]
                + [set_average(records, f, sets, **sel(label)) for f in fields])

    for label in labels:
        rows.append([label] + values(label))
    for a, b in ratio_rows:
        va, vb = values(a), values(b)
        rows.append([f"{a} / {b}"] + [f"{x / y:.3f}x" for x, y in zip(va, vb)])
    for a, b in delta_rows:
        cells, diffs, ses = [], [], []
        for s in sets:
            ra, rb = one(records, set=s, **sel(a)), one(records, set=s, **sel(b))
            diffs.append(ra["tau"] - rb["tau"])
            ses.append(paired_diff_se(ra, rb))
            cells += [f"{diffs[-1]:+.2f} ± {ses[-1]:.2f}" if f == "tau" else ""
                      for f in fields]
        avg_se = float(np.sqrt(np.sum(np.square(ses)))) / len(sets)
        cells += [f"{np.mean(diffs):+.2f} ± {avg_se:.2f}" if f == "tau" else ""
                  for f in fields]
        rows.append([f"{a} - {b} (τ ± SE)"] + cells)
    return markdown(header, rows)


# -------------------------------------------------------------------- real trees


@dataclasses.dataclass(frozen=True)
class Captured:
    """Decode rounds captured at C contexts (host numpy arrays).

    Attributes:
      tree: `DraftTree` with [C, N] fields.
      logits: float32 [C, N, V] target logits at the tree's nodes (the verify pass).
      draft_logits: float32 [C, H, V] the drafter's block.
      starts: int [C] committed length before the root (the tree sits at start + depth).
      contexts: the C token sequences (the last token is the root).
    """

    tree: DraftTree
    logits: np.ndarray
    draft_logits: np.ndarray
    starts: np.ndarray
    contexts: list[list[int]]

    def tree_at(self, c: int) -> DraftTree:
        return jax.tree.map(lambda x: x[c], self.tree)


def _capture_impl(graphdef, params, tokens_BT, lengths_B, *, budget, taps, max_len):
    target, drafter = nnx.merge(graphdef, params)
    b = tokens_BT.shape[0]
    start_B = lengths_B - 1
    cache = target.init_cache(b, max_len)
    _, feats, cache = target.prefill(cache, tokens_BT, start_B, taps=taps)
    root_B = jnp.take_along_axis(tokens_BT, start_B[:, None], axis=1)[:, 0]
    ctx = drafter.init_context(target, b, max_len)
    ctx = drafter.extend_context(target, ctx, tokens_BT, feats, jnp.zeros_like(start_B),
                                 start_B)
    draft_BHV, _ = drafter.draft(target, ctx, root_B, start_B)
    draft_BHV = draft_BHV.astype(jnp.float32)
    tree = jax.vmap(lambda l, r: ddtree.build_tree(l, r, budget)[0])(draft_BHV, root_B)
    anc_BNN = jax.vmap(ancestor_mask)(tree)
    logits, _, _ = target.verify_tree(cache, tree.tokens, tree.depths, anc_BNN, start_B)
    return tree, logits, draft_BHV


_capture_jit = jax.jit(_capture_impl, static_argnames=("graphdef", "budget", "taps", "max_len"))


def capture_trees(models: Models, drafter: str, contexts: Sequence[Sequence[int]],
                  budget: int) -> Captured:
    """One decode round at each context: the drafter's DDTree and the target's logits.

    The last token of each context is the root (the pending token); the target has
    consumed the tokens before it and the drafter sees their tapped features, exactly
    as in a decode round at that point.
    """
    if any(len(c) < 2 for c in contexts):
        raise ValueError("every context needs at least 2 tokens (committed tokens + root)")
    d = drafters.as_drafter(models.drafters[drafter])
    width = -(-max(len(c) for c in contexts) // _ALIGN) * _ALIGN
    tokens = np.zeros((len(contexts), width), np.int32)
    for i, c in enumerate(contexts):
        tokens[i, : len(c)] = c
    lengths = np.asarray([len(c) for c in contexts], np.int32)
    max_len = -(-(width + budget + 1) // _ALIGN) * _ALIGN
    graphdef, params = nnx.split((models.target, d))
    tree, logits, draft = _capture_jit(graphdef, params, jnp.asarray(tokens),
                                       jnp.asarray(lengths), budget=budget,
                                       taps=tuple(d.target_layer_ids), max_len=max_len)
    return Captured(tree=jax.tree.map(np.asarray, tree), logits=np.asarray(logits),
                    draft_logits=np.asarray(draft), starts=lengths - 1,
                    contexts=[list(c) for c in contexts])


def target_continuations(models: Models, prompts: dict[str, list[list[int]]], setup: Setup,
                         temperature: float = 0.0) -> dict[str, list[list[int]]]:
    """The target's own continuation of every prompt at ``temperature`` (greedy at 0;
    ``setup.max_new_tokens`` tokens, fewer where it stopped), per set."""
    pool = RunnerPool(models, setup)
    out = {}
    for name, ps in prompts.items():
        runner, params = pool.get(AR, Sampling(temperature=temperature), len(ps))
        out[name] = runner(params, ps, jax.random.key(setup.seed)).rows()
    return out


def continuation_contexts(models: Models, prompts: dict[str, list[list[int]]], setup: Setup,
                          cuts: Sequence[int]) -> list[list[int]]:
    """Contexts = prompt + the target's greedy continuation up to each cut (root included).

    Cut k gives ``prompt + continuation[:k + 1]`` (the root is the (k+1)-th generated
    token); cuts past a continuation that stopped early are skipped.
    """
    conts = target_continuations(models, prompts, setup)
    return [list(p) + cont[: k + 1] for name, ps in prompts.items()
            for p, cont in zip(ps, conts[name]) for k in cuts if k + 1 <= len(cont)]


@functools.lru_cache(maxsize=None)
def _exit_laws_jit(sampling: Sampling):
    return jax.jit(jax.vmap(lambda t, l: exit_law(t, l, sampling)))


def exit_laws(cap: Captured, sampling: Sampling):
    """The exit law (`tev_jax.exit_law.ExitLaw`, [C, ...] numpy fields) of every tree."""
    return jax.tree.map(np.asarray, _exit_laws_jit(sampling)(cap.tree, cap.logits))


def verifier_fn(name: str, sampling: Sampling, horizon: int) -> Callable:
    """``(key, tree, logits_NV) -> Verdict`` for 'tev', 'predraw', 'sequential', 'greedy'."""
    if name == "greedy":
        return lambda key, tree, logits: verify_lib.greedy(tree, logits, horizon=horizon)
    fn = {"tev": verify_lib.tev, "predraw": verify_lib.predraw,
          "sequential": verify_lib.sequential_residual}[name]
    return lambda key, tree, logits: fn(key, tree, logits, sampling, horizon=horizon)


@functools.lru_cache(maxsize=None)
def _lengths_jit(verifier: str, sampling: Sampling, horizon: int):
    fn = verifier_fn(verifier, sampling, horizon)

    def run(keys_CK, tree, logits):
        one_tree = lambda ks, t, l: jax.vmap(lambda k: fn(k, t, l).length)(ks)
        return jax.lax.map(lambda a: one_tree(*a), (keys_CK, tree, logits))

    return jax.jit(run)


def fixed_tree_lengths(cap: Captured, sampling: Sampling, verifier: str, horizon: int,
                       draws: int, seed: int = 0) -> np.ndarray:
    """Output-block lengths of ``draws`` independent verifications of every captured tree
    (the same tree and logits each time); int [C, draws]."""
    c = cap.logits.shape[0]
    keys = jax.random.split(jax.random.key(seed), c * draws).reshape(c, draws)
    return np.asarray(_lengths_jit(verifier, sampling, horizon)(keys, cap.tree, cap.logits))


# -------------------------------------------------------------------------- timing


def time_round_robin(calls: dict[str, Callable[[int], Any]], repeats: int, seed: int = 0
                     ) -> dict[str, np.ndarray]:
    """Seconds of each ``call(i)`` (i = repeat index), methods in a fresh random order
    every repeat so that load drift hits them alike. Call each once before (compile)."""
    for call in calls.values():
        jax.block_until_ready(call(0))
    rng = np.random.default_rng(seed)
    out = {name: [] for name in calls}
    names = list(calls)
    for i in range(repeats):
        for name in rng.permutation(names):
            t0 = time.perf_counter()
            jax.block_until_ready(calls[name](i))
            out[name].append(time.perf_counter() - t0)
    return {k: np.asarray(v) for k, v in out.items()}


@functools.lru_cache(maxsize=None)
def _decide_jits(name: str, sampling: Sampling, horizon: int):
    """(decide, decide + commit) jitted as decode's decide stage runs them (batch 1)."""
    fn = verifier_fn(name, sampling, horizon)

    def decide(k, t, l):
        return jax.vmap(fn)(k[None], t, l)

    def step(k, t, l, cache, start):
        v = decide(k, t, l)
        return v, kvc.commit(cache, start, v.path, v.length)

    return jax.jit(decide), jax.jit(step, donate_argnums=(3,))


def verifier_stage_calls(cap: Captured, sampling: Sampling, verifiers: Sequence[str],
                         horizon: int, cache_len: int, target
                         ) -> dict[str, Callable[[int], Any]]:
    """Batch-1 calls of the verify stage as decode runs it, cycling over the captured
    trees: ``name`` = the verifier alone (decide), ``name+commit`` = the verifier then the
    KV-cache commit of its path (a donated cache of ``cache_len`` slots, as in decode)."""
    c = cap.logits.shape[0]
    trees = [jax.tree.map(lambda x: jnp.asarray(x[i:i + 1]), cap.tree) for i in range(c)]
    logits = [jnp.asarray(cap.logits[i:i + 1]) for i in range(c)]
    starts = [jnp.asarray(cap.starts[i:i + 1], jnp.int32) for i in range(c)]
    # a list of per-tree keys: indexing a key array inside a timed call would add an
    # eager device op to every measurement
    keys = list(jax.random.split(jax.random.key(0), c))
    calls = {}
    for name in verifiers:
        decide, step = _decide_jits(name, sampling, horizon)
        calls[name] = (lambda i, d=decide: d(keys[i % c], trees[i % c], logits[i % c]))
        holder = {"cache": target.init_cache(1, cache_len)}

        def call(i, step=step, holder=holder):
            v, holder["cache"] = step(keys[i % c], trees[i % c], logits[i % c],
                                      holder["cache"], starts[i % c])
            return v

        calls[name + "+commit"] = call
    return calls


def verify_forward_call(models: Models, cap: Captured, cache_len: int, taps=()
                        ) -> Callable[[int], Any]:
    """Batch-1 call of the target's tree verify pass over the captured trees (the
    forward every verifier shares; a zero cache of ``cache_len`` slots)."""
    graphdef, params = nnx.split(models.target)
    c = cap.logits.shape[0]
    trees = [jax.tree.map(lambda x: jnp.asarray(x[i:i + 1]), cap.tree) for i in range(c)]
    starts = [jnp.asarray(cap.starts[i:i + 1], jnp.int32) for i in range(c)]
    cache = models.target.init_cache(1, cache_len)

    @jax.jit
    def fwd(params, cache, tree, start):
        target = nnx.merge(graphdef, params)
        anc = jax.vmap(ancestor_mask)(tree)
        return target.verify_tree(cache, tree.tokens, tree.depths, anc, start, taps=taps)[0]

    return lambda i: fwd(params, cache, trees[i % c], starts[i % c])


# ------------------------------------------------------------------------- outputs


def machine_info() -> dict:
    return dict(platform=platform.platform(), cpus=os.cpu_count(), jax=jax.__version__,
                backend=jax.default_backend(), load_average=os.getloadavg())


def setup_line(setup: Setup, models: Models, *, timed: bool = True) -> str:
    """One sentence stating what a table was measured on."""
    d = models.describe()
    repeats = f", {setup.repeats} timed repeat(s)" if timed else ""
    return (f"{setup.prompts_per_set} prompts per set, {setup.max_new_tokens} new tokens, "
            f"prompts ≤ {setup.prompt_len} tokens, seed {setup.seed}{repeats}; "
            f"target {d['target_params'] / 1e6:.1f} M params "
            f"(V = {d['vocab']}), drafter {d['drafter_layers']} layer(s), block "
            f"{d['block_size']}; {platform.machine()} CPU x{os.cpu_count()}, jax "
            f"{jax.__version__}, load average {os.getloadavg()[0]:.1f}")


README_BEGIN = "<!-- results:begin -->"
README_END = "<!-- results:end -->"


def write_outputs(study_dir: Path, args: argparse.Namespace, setup: Setup | None,
                  models: Models | None, result: dict, table_md: str, started: float
                  ) -> Path:
    """Writes the results JSON, prints the tables, and (full runs on the real models
    only) replaces the README block between the results markers with ``table_md``.

    Output file: ``--out``, else results_quick.json (``--quick``), results_random.json
    (``--random-models``) or results.json.
    """
    full = not args.quick and not getattr(args, "random_models", False)
    if args.out:
        out = Path(args.out)
    else:
        out = study_dir / ("results_random.json" if getattr(args, "random_models", False)
                           else "results_quick.json" if args.quick else "results.json")
    payload = dict(study=study_dir.name, command=" ".join(sys.argv),
                   setup=None if setup is None else dataclasses.asdict(setup),
                   models=None if models is None else models.describe(),
                   machine=machine_info(), total_seconds=time.time() - started,
                   **result, table_markdown=table_md)
    out.write_text(json.dumps(payload, indent=1, default=_json_default))
    print(table_md)
    if full and not args.out:
        readme = study_dir / "README.md"
        text = readme.read_text()
        if README_BEGIN in text and README_END in text:
            head, rest = text.split(README_BEGIN, 1)
            _, tail = rest.split(README_END, 1)
            readme.write_text(f"{head}{README_BEGIN}\n{table_md}\n{README_END}{tail}")
            print(f"updated {readme}")
    print(f"wrote {out} ({payload['total_seconds']:.0f} s)")
    return out


def _json_default(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, tuple):
        return list(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def study_parser(doc: str, **defaults) -> argparse.ArgumentParser:
    """An argument parser with the shared flags; the description is the docstring's
    first line."""
    ap = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    return add_arguments(ap, **defaults)
