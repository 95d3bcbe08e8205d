"""``python -m train``: a thin CLI over `train.loop.train` and `train.rollouts`.

    python -m train rollouts --target DIR --prompts-file prompts.jsonl --out DATA \\
        [--process-index I --process-count P | --distributed]
    python -m train rollouts --merge --out DATA     # manifest of shards already written
    python -m train run --target-path DIR --data-dir DATA --loss exit --steps 2000 \\
        --out-dir runs/exit [--config base.json] [--mesh-fsdp 8] [--until-update 500]
    python -m train plan --target qwen3-4b --mesh-fsdp 8 --batch 8 --seq-len 2048

Every `TrainConfig` field is a ``--flag`` (underscores become dashes); ``--recipe
paper`` starts from a named preset (`train.config.RECIPES`, the authors' ExitTrain
settings), ``--config`` reads a JSON file over it and flags override both.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from pathlib import Path

from train.config import RECIPES, TrainConfig


def _field_parser(tp):
    """An argparse ``type`` for a TrainConfig field annotation (``'none'`` -> None)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if tp is bool:
        return lambda s: s.lower() in ("1", "true", "yes", "on")
    if typing.get_origin(tp) is tuple:
        item = typing.get_args(tp)[0]
        return lambda s: None if s.lower() == "none" else tuple(
            item(x) for x in s.split(",") if x)
    return lambda s: None if s.lower() == "none" else tp(s)


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=None,
                       type=_field_parser(hints[f.name]),
                       help=f"(default {f.default!r})")


def config_from_args(ns: argparse.Namespace) -> TrainConfig:
    base = dict(RECIPES[ns.recipe]) if ns.recipe else {}
    if ns.config is not None:
        base.update(json.loads(Path(ns.config).read_text()))
    for f in dataclasses.fields(TrainConfig):
        v = getattr(ns, f.name)
        if v is not None:
            base[f.name] = v
    return TrainConfig.from_dict(base)


def _read_prompts(ns, tokenizer) -> list[list[int]]:
    texts = []
    if ns.prompts_file:
        for line in Path(ns.prompts_file).read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                text = rec.get("prompt", rec.get("text"))
                if text is None:
                    raise ValueError(f"{ns.prompts_file}: a record has neither 'prompt' nor 'text'")
                texts.append(text)
    for name in ns.prompt_set or ():
        from tev_jax.data import prompt_set

        print(f"warning: prompt set {name!r} is an evaluation set; training on its rollouts "
              "leaks it into the drafter", file=sys.stderr)
        texts.extend(prompt_set(name))
    if not texts:
        raise ValueError("no prompts: give --prompts-file and/or --prompt-set")
    if ns.limit:
        texts = texts[: ns.limit]
    return [tokenizer.encode(t).ids for t in texts]


def _rollouts(ns) -> None:
    from tev_jax.models import load_target, load_tokenizer
    from tev_jax.sampling import Sampling
    from train.rollouts import RolloutConfig, make_rollouts, write_manifest

    if ns.merge:
        manifest = write_manifest(ns.out)
        print(f"wrote the manifest of {manifest['num_sequences']} sequences in "
              f"{len(manifest['shards'])} shards to {ns.out}")
        return
    if ns.target is None:
        raise ValueError("--target is required (except with --merge)")
    index, count = ns.process_index, ns.process_count
    if ns.distributed:
        import jax

        jax.distributed.initialize()
        index, count = jax.process_index(), jax.process_count()
    target = load_target(ns.target)
    tokenizer = load_tokenizer(ns.tokenizer or ns.target)
    prompts = _read_prompts(ns, tokenizer)
    stop = tuple(target.config.eos_token_ids) if ns.stop_ids is None else tuple(
        int(s) for s in ns.stop_ids.split(",") if s)
    rc = RolloutConfig(max_prompt_len=ns.max_prompt_len, max_new_tokens=ns.max_new_tokens,
                       sampling=Sampling(ns.temperature, ns.top_k, ns.top_p),
                       stop_token_ids=stop, batch_size=ns.batch_size,
                       shard_size=ns.shard_size, pad_id=ns.pad_id, seed=ns.seed)
    done = []

    def progress(n):
        done.append(n)
        print(f"{sum(done)} sequences", end="\r")

    manifest = make_rollouts(target, prompts, ns.out, rc, info={"target": str(ns.target)},
                             progress=progress, process_index=index, process_count=count)
    if manifest is None:
        print(f"\nprocess {index}/{count}: wrote its shards to {ns.out}; the last process "
              "to finish writes the manifest (or run with --merge)")
    else:
        print(f"\nwrote {manifest['num_sequences']} sequences of length "
              f"{manifest['seq_len']} to {ns.out}")


def _run(ns) -> None:
    from train.loop import train

    cfg = config_from_args(ns)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    result = train(cfg, until_update=ns.until_update, max_minutes=ns.max_minutes,
                   progress=not ns.no_progress)
    if result.history:
        last = result.history[-1]
        print(json.dumps({k: last[k] for k in sorted(last)}))
    if result.preempted:
        print("preempted (SIGTERM): saved a checkpoint after the last update; run the same "
              "command again to resume", file=sys.stderr)


def _plan(ns) -> None:
    import os

    if ns.host_devices:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={ns.host_devices}")
    from train.plan import plan_step, target_config_from

    plan = plan_step(
        target_config_from(ns.target, ns.target_layers), drafter_layers=ns.drafter_layers,
        num_taps=ns.num_taps, block_size=ns.block_size, batch=ns.batch, seq_len=ns.seq_len,
        anchors=ns.anchors, budget=ns.budget, loss=ns.loss,
        mesh_shape=(ns.mesh_data, ns.mesh_fsdp, ns.mesh_tensor), target_dtype=ns.target_dtype,
        param_dtype=ns.param_dtype, compute_dtype=ns.compute_dtype,
        target_sharding=ns.target_sharding, remat=ns.remat,
        score_capacities=tuple(float(c) for c in ns.score_capacities.split(",") if c),
        topology=ns.topology)
    print(json.dumps(plan.to_dict()) if ns.json else plan.format())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("rollouts", help="generate target responses to prompts")
    r.add_argument("--target", help="Hugging Face target directory")
    r.add_argument("--tokenizer", help="tokenizer.json or its directory (default: --target)")
    r.add_argument("--prompts-file", help="JSONL with a 'prompt' (or 'text') field")
    r.add_argument("--prompt-set", action="append", help="a bundled prompt set (eval data!)")
    r.add_argument("--limit", type=int, default=0, help="use only the first N prompts")
    r.add_argument("--out", required=True)
    r.add_argument("--max-prompt-len", type=int, default=256)
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--temperature", type=float, default=1.0)
    r.add_argument("--top-k", type=int)
    r.add_argument("--top-p", type=float)
    r.add_argument("--stop-ids", help="comma-separated (default: the target's eos ids)")
    r.add_argument("--batch-size", type=int, default=16)
    r.add_argument("--shard-size", type=int, default=4096)
    r.add_argument("--pad-id", type=int, default=0)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--process-index", type=int, default=0,
                   help="this process writes the shards i with i %% count == index")
    r.add_argument("--process-count", type=int, default=1)
    r.add_argument("--distributed", action="store_true",
                   help="index and count from jax.distributed.initialize()")
    r.add_argument("--merge", action="store_true",
                   help="only write the manifest of the shards in --out")
    r.set_defaults(fn=_rollouts)

    t = sub.add_parser("run", help="train a drafter (resumes from --out-dir)")
    t.add_argument("--recipe", choices=sorted(RECIPES),
                   help="start from a named preset of TrainConfig fields (paper: the "
                        "authors' ExitTrain recipe)")
    t.add_argument("--config", help="JSON file of TrainConfig fields (over --recipe)")
    _add_config_flags(t)
    t.add_argument("--until-update", type=int, help="stop (with a checkpoint) after this update")
    t.add_argument("--max-minutes", type=float, help="stop (with a checkpoint) after this time")
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(fn=_run)

    pl = sub.add_parser("plan", help="per-device memory of a training step (no weights)")
    pl.add_argument("--target", required=True,
                    help="a preset (tev_jax.plan.PRESETS) or an HF config.json / directory")
    pl.add_argument("--target-layers", type=int, help="cut the target to this many layers")
    pl.add_argument("--drafter-layers", type=int, default=1)
    pl.add_argument("--num-taps", type=int, default=5, help="target layers the drafter reads")
    pl.add_argument("--block-size", type=int, default=16)
    pl.add_argument("--batch", type=int, default=8, help="B sequences (global)")
    pl.add_argument("--seq-len", type=int, default=2048)
    pl.add_argument("--anchors", type=int, default=32)
    pl.add_argument("--budget", type=int, default=32)
    pl.add_argument("--loss", default="exit")
    pl.add_argument("--mesh-data", type=int, default=1)
    pl.add_argument("--mesh-fsdp", type=int, default=8)
    pl.add_argument("--mesh-tensor", type=int, default=1)
    pl.add_argument("--target-dtype", default="float32")
    pl.add_argument("--param-dtype", default="float32")
    pl.add_argument("--compute-dtype", help="default: param dtype")
    pl.add_argument("--target-sharding", default="fsdp")
    pl.add_argument("--remat", default="none")
    pl.add_argument("--score-capacities", default="", help="comma-separated fractions")
    pl.add_argument("--topology", default=None, metavar="NAME",
                    help="plan for a TPU slice (e.g. v5p:2x2x2, v5e:4x4; needs the tpu "
                         "extra and JAX_PLATFORMS=cpu off TPU) instead of the local devices")
    pl.add_argument("--host-devices", type=int, default=0,
                    help="simulate this many CPU devices (sets XLA_FLAGS; CPU only)")
    pl.add_argument("--json", action="store_true", help="print one JSON record")
    pl.set_defaults(fn=_plan)
    return p


def main(argv=None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        ns.fn(ns)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
