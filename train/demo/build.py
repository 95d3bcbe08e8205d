"""Every bundled demo artefact, from the source data in data/ to the shipped models, in order.

    python -m train.demo.build                  # all stages; a finished stage is skipped
    python -m train.demo.build --only rollouts  # one stage (reruns it if its output exists)
    python -m train.demo.build --set prompts=64 --set dflash_steps=10 --runs /tmp/demo
    python -m train.demo.build --target tev_jax/data/models/target --only prompts \
        --only rollouts --only dflash             # drafters for the bundled target

Stages (outputs under ``--runs``, default ``runs/``; every stage resumes or restarts
deterministically, and its seed and log are in its output folder):

=============  =====================================================================
corpus         token arrays of the offline corpus (``train.demo.prepare_corpus``)
target         the Qwen3 target pre-trained on it (``train.demo.train_target``)
prompts        training prompts from the corpus' train split (``train.demo.prompts``)
rollouts       the target's answers to them, T = 1 (``python -m train rollouts``)
dflash         the DFlash drafter, token objective, from scratch (``python -m train run``)
ft_token       fine-tunes of ``dflash`` with the same data, steps and optimiser:
ft_exit        token-only, ExitTrain with exit weights, prefix weights and exit-depth
ft_prefix      weights (budget 64; the ablation of the paper's Table 2)
ft_exit_depth
bundle         target + the ExitTrain drafter ``DemoPlan.exittrain`` (a fine-tune of the
               recipe sweep, ``experiments/exit_recipe/run.py``, run before this stage)
               + ``dflash`` into ``tev_jax/data/models`` (float32)
=============  =====================================================================
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class DemoPlan:
    """The settings of the shipped demo models (what the README's numbers come from)."""

    target_steps: int = 1700
    prompts: int = 3000
    max_prompt_len: int = 128
    max_new_tokens: int = 192
    drafter_layers: int = 1
    drafter_taps: str = ""  # target layers the drafter reads, e.g. "1,3" ("" = DFlash spacing)
    block_size: int = 16
    batch_size: int = 8
    num_anchors: int = 16
    dflash_steps: int = 500  # the shipped drafter (2 000 in the previous session's ablation)
    dflash_lr: float = 1e-3
    finetune_steps: int = 400
    finetune_lr: float = 2e-4
    finetune_batch_size: int = 4
    finetune_anchors: int = 8
    budget: int = 64
    exit_lambda: float = 1.0
    seed: int = 0
    # the bundle's ExitTrain drafter, under --runs (chosen by experiments/exit_recipe)
    exittrain: str = "exit_recipe/weight-exit-l0.03"


FINETUNES = {"ft_token": "token", "ft_exit": "exit", "ft_prefix": "prefix",
             "ft_exit_depth": "exit_depth"}
STAGES = ("corpus", "target", "prompts", "rollouts", "dflash", *FINETUNES, "bundle")


def target_dir(runs: Path, target: str | None = None) -> Path:
    """The target's HF folder: ``target`` when given (e.g. the bundled one), else the
    target stage's output."""
    return Path(target) if target else runs / "target" / "hf"


def drafter_args(plan: DemoPlan, runs: Path, name: str, target: str | None = None) -> list[str]:
    """The `python -m train` arguments of drafter stage ``name`` (dflash or a fine-tune)."""
    common = ["run", "--target-path", str(target_dir(runs, target)),
              "--data-dir", str(runs / "rollouts"), "--seed", str(plan.seed),
              "--out-dir", str(runs / "drafters" / name), "--checkpoint-every", "100"]
    if name == "dflash":
        taps = ["--target-layer-ids", plan.drafter_taps] if plan.drafter_taps else []
        return common + taps + [
            "--loss", "token", "--drafter-layers", str(plan.drafter_layers),
            "--batch-size", str(plan.batch_size), "--num-anchors", str(plan.num_anchors),
            "--block-size", str(plan.block_size), "--steps", str(plan.dflash_steps),
            "--lr", str(plan.dflash_lr),
            "--warmup-steps", str(min(100, plan.dflash_steps // 10)), "--end-lr-ratio", "0.05"]
    return common + ["--drafter-path", str(runs / "drafters" / "dflash" / "drafter"),
                     "--batch-size", str(plan.finetune_batch_size),
                     "--num-anchors", str(plan.finetune_anchors),
                     "--loss", FINETUNES[name], "--budget", str(plan.budget),
                     "--exit-lambda", str(plan.exit_lambda), "--tree-metrics", "true",
                     "--steps", str(plan.finetune_steps), "--lr", str(plan.finetune_lr),
                     "--warmup-steps", str(min(20, plan.finetune_steps // 10)),
                     "--end-lr-ratio", "0.1"]


def _output(stage: str, runs: Path, target: str | None = None) -> Path:
    return {
        "corpus": runs / "corpus" / "manifest.json",
        "target": target_dir(runs, target) / "config.json",
        "prompts": runs / "prompts.jsonl",
        "rollouts": runs / "rollouts" / "manifest.json",
        "bundle": REPO_ROOT / "tev_jax" / "data" / "models" / "target" / "config.json",
    }.get(stage, runs / "drafters" / stage / "drafter" / "config.json")


def run_stage(stage: str, plan: DemoPlan, runs: Path, target: str | None = None,
              data_dir: str | None = None) -> None:
    """Runs one stage through its own command-line entry point (``target``: an existing
    target folder that replaces the target stage; ``data_dir``: the source data folder)."""
    data = ["--data-dir", data_dir] if data_dir else []
    if stage == "target" and target:
        raise ValueError(f"--target {target} replaces the target stage; do not run it")
    if stage == "corpus":
        from train.demo.prepare_corpus import main
        main(["--out", str(runs / "corpus"), *data])
    elif stage == "target":
        from train.demo.train_target import main
        main(["--corpus", str(runs / "corpus"), "--out", str(runs / "target"),
              "--steps", str(plan.target_steps), "--seed", str(plan.seed),
              "--eval-every", str(plan.target_steps // 4)])
    elif stage == "prompts":
        from train.demo.prompts import main
        main(["--out", str(runs / "prompts.jsonl"), "--count", str(plan.prompts),
              "--seed", str(plan.seed), *data])
    elif stage == "rollouts":
        from train.__main__ import main
        code = main(["rollouts", "--target", str(target_dir(runs, target)),
                     "--prompts-file", str(runs / "prompts.jsonl"),
                     "--out", str(runs / "rollouts"),
                     "--max-prompt-len", str(plan.max_prompt_len),
                     "--max-new-tokens", str(plan.max_new_tokens),
                     "--temperature", "1.0", "--batch-size", "64", "--seed", str(plan.seed)])
        if code:
            raise SystemExit(code)
    elif stage == "bundle":
        from train.demo.export_bundled import main
        main(["--target", str(target_dir(runs, target)),
              "--exittrain", str(runs / plan.exittrain / "drafter"),
              "--dflash", str(runs / "drafters" / "dflash" / "drafter")])
    else:
        from train.__main__ import main
        code = main(drafter_args(plan, runs, stage, target))
        if code:
            raise SystemExit(code)


def plan_with(overrides: list[str]) -> DemoPlan:
    """`DemoPlan` with ``name=value`` overrides (values parsed as the field's type)."""
    plan = DemoPlan()
    types = {f.name: type(getattr(plan, f.name)) for f in dataclasses.fields(plan)}
    changes = {}
    for item in overrides:
        name, sep, value = item.partition("=")
        if not sep or name not in types:
            raise ValueError(f"--set expects name=value with name in {sorted(types)}, got {item!r}")
        changes[name] = types[name](value)
    return dataclasses.replace(plan, **changes)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.demo.build",
                                description=__doc__.split("\n")[0])
    p.add_argument("--runs", default=str(REPO_ROOT / "runs"),
                   help="the folder every stage writes its output to (default: runs/ in the "
                        "repository)")
    p.add_argument("--only", choices=STAGES, action="append",
                   help="run just these stages (even when their output exists)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="override a DemoPlan field (smoke runs)")
    p.add_argument("--target", default=None,
                   help="an existing target HF folder (e.g. tev_jax/data/models/target): "
                        "the target stage is skipped and every later stage uses it")
    p.add_argument("--data-dir", default=None,
                   help="the source data (default: data/ in the repository)")
    args = p.parse_args(argv)
    try:
        _run(args)
    except ValueError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    return 0


def _run(args) -> None:
    plan, runs = plan_with(args.set), Path(args.runs)
    for stage in args.only or STAGES:
        if stage == "target" and args.target:
            print(f"[demo_models] target: given ({args.target})")
            continue
        if not args.only and _output(stage, runs, args.target).exists():
            print(f"[demo_models] {stage}: done ({_output(stage, runs, args.target)})")
            continue
        print(f"[demo_models] {stage}: running")
        run_stage(stage, plan, runs, args.target, args.data_dir)


if __name__ == "__main__":
    sys.exit(main())
