"""``python -m train``: a thin CLI over `train.loop.train` and `train.rollouts`.

    python -m train rollouts --target DIR --prompts-file prompts.jsonl --out DATA \\
        [--process-index I --process-count P | --distributed]
    python -m train rollouts --merge --out DATA     # manifest of shards already written
    python -m train run --target-path DIR --data-dir DATA --objective exittrain \\
        --steps 2000 --out-dir runs/exit [--config base.json] [--mesh-fsdp 8] \\
        [--until-update 500]
    python -m train run --recipe opd --target-path DIR --data-dir DATA \\
        --drafter-path runs/token/drafter --steps 200 --out-dir runs/opd
    python -m train plan --target qwen3-4b --mesh-fsdp 8 --batch 8 --seq-len 2048

Every `TrainConfig` field is a ``--flag`` (underscores become dashes); ``--recipe
paper`` starts from a named preset (`train.config.RECIPES`, the authors' ExitTrain
settings), ``--config`` reads a JSON file over it and flags override both.

Exit codes (as ``tev-jax``'s, `tev_jax.runtime.exit_codes`): 0 done (or stopped where asked, with
``--until-update`` / ``--max-minutes``); 2 bad input or a refused run (one line on
stderr, nothing written); 75 ``run`` stopped by SIGTERM or SIGINT after an update
(checkpoint saved) or ``rollouts`` between shards: run the same command again to resume;
130 / 143 ``plan`` interrupted / terminated. A second signal ends any command at once
(128 + its number).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import signal
import sys
import types
import typing
from pathlib import Path

from tev_jax.runtime.exit_codes import check_readable

DESCRIPTION = ("Drafter training for tree speculative decoding: target rollouts, DFlash / "
               "ExitTrain training runs (resumable), memory plans.")


NONE = "none"
"""What a flag of an optional field reads as None (``--steps none`` is refused)."""
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class _Unset:
    """An optional field set to None on the command line (over --recipe / --config),
    apart from a flag not given (argparse's None)."""

    def __repr__(self):
        return NONE


UNSET = _Unset()


def _field_parser(tp):
    """An argparse ``type`` for a TrainConfig field annotation: ``'none'`` for an optional
    field (`UNSET`), strict booleans, ints, floats and comma-separated tuples."""
    optional = typing.get_origin(tp) in (typing.Union, types.UnionType)
    if optional:
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    item = typing.get_args(tp)[0] if typing.get_origin(tp) is tuple else None
    what = {bool: "true or false", int: "an int", float: "a number", str: "a string"}.get(
        item or tp, "a value")
    if item is not None:
        what = f"comma-separated {what.removeprefix('an ').removeprefix('a ')}s"

    def parse(s):
        if s.lower() == NONE:
            if optional:
                return UNSET
            raise argparse.ArgumentTypeError(f"takes {what}, not {s!r} (it has no 'none')")
        try:
            if tp is bool:
                if s.lower() not in TRUE + FALSE:
                    raise ValueError
                return s.lower() in TRUE
            if item is not None:
                return tuple(item(x) for x in s.split(",") if x)
            return tp(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"takes {what}, got {s!r}") from None

    return parse


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    from train.config import TrainConfig, field_help

    hints = typing.get_type_hints(TrainConfig)
    helps = field_help()
    for f in dataclasses.fields(TrainConfig):
        text = helps[f.name].replace("%", "%%")
        names = ["--" + f.name.replace("_", "-")] + (["--init-from"] if f.name == "drafter_path"
                                                     else [])
        p.add_argument(*names, dest=f.name, default=None,
                       type=_field_parser(hints[f.name]),
                       help=f"{text} (default {f.default!r})")


NEW_DRAFTER_FIELDS = ("drafter_layers", "block_size", "mask_token_id", "target_layer_ids")
"""The `TrainConfig` fields that shape a new drafter (ignored with ``drafter_path``)."""


def config_from_args(ns: argparse.Namespace) -> TrainConfig:
    from tev_jax.text_io import read_text
    from train.config import RECIPES, TrainConfig

    base = dict(RECIPES[ns.recipe]) if ns.recipe else {}
    if ns.config is not None:
        try:
            base.update(json.loads(read_text(ns.config)))
        except json.JSONDecodeError as e:
            raise ValueError(f"--config {ns.config}:{e.lineno}: malformed JSON ({e.msg})"
                             ) from None
    for f in dataclasses.fields(TrainConfig):
        v = getattr(ns, f.name)
        if v is not None:
            base[f.name] = None if v is UNSET else v
    if base.get("drafter_path") is not None:
        new_only = [f"--{name.replace('_', '-')}" for name in NEW_DRAFTER_FIELDS
                    if base.get(name, getattr(TrainConfig, name))
                    != getattr(TrainConfig, name)]
        if new_only:
            raise ValueError(f"{', '.join(new_only)} shape a new drafter; --drafter-path "
                             f"{base['drafter_path']} fine-tunes one whose config.json "
                             "decides them: drop them, or drop --drafter-path")
    for name in ("target_path", "drafter_path"):
        base[name] = _bundled_dir(name, base.get(name))
    default_warmup = TrainConfig.warmup_steps
    steps = base.get("steps", TrainConfig.steps)
    if "warmup_steps" not in base and isinstance(steps, int) and 0 < steps < default_warmup:
        base["warmup_steps"] = steps  # the default warmup, cut to a shorter run
    return TrainConfig.from_dict(base)


BUNDLED = "bundled"
"""``--target bundled``: the bundled demo target."""


def _bundled_dir(field: str, value):
    """``bundled`` as a target (the bundled target's folder) or a drafter (``bundled`` /
    ``bundled:NAME``: a bundled drafter's folder); other values as they are."""
    if not isinstance(value, str) or not (value == BUNDLED or value.startswith(BUNDLED + ":")):
        return value
    from tev_jax.models.bundled import DEFAULT_DRAFTER, bundled_paths, check_drafter_name

    if field == "target_path":
        if value != BUNDLED:
            raise ValueError(f"--target-path {value}: the bundle has one target, 'bundled'")
        return str(bundled_paths(drafters=()).target)
    name = value[len(BUNDLED) + 1:] or DEFAULT_DRAFTER
    check_drafter_name(name)
    return str(bundled_paths(drafters=(name,)).drafters[name])


def _ints_flag(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated token ids, got {text!r}") from None


def _read_prompts(ns, tokenizer, target) -> list[list[int]]:
    """Token ids of --prompts-file and --prompt-set, read by the prompt reader of
    ``tev-jax generate --prompts`` (`tev_jax.batch.outputs`): JSONL of prompt / messages /
    prompt_ids records (ids optional here) or plain text, bundled sets included; cut to
    their last --max-prompt-len tokens, and checked against the vocabulary and the
    target's context length."""
    from tev_jax import text_io

    sources = ([ns.prompts_file] if ns.prompts_file else []) + [
        text_io.BUNDLED_PREFIX + name for name in ns.prompt_set or ()]
    if not sources:
        raise ValueError("no prompts: give --prompts-file and/or --prompt-set")
    folder = Path(ns.tokenizer or ns.target)
    folder = folder if folder.is_dir() else folder.parent
    chat = text_io.chat_formatter(folder)
    requests = []
    for source in sources:
        records = text_io.read_prompts(source, line_ids=True)
        if text_io.bundled_set(source) is not None:
            print(f"warning: {source} is an evaluation set; training on its rollouts leaks "
                  "it into the drafter", file=sys.stderr)
        requests += text_io.encode_records(
            records, tokenizer, chat, vocab_size=target.config.vocab_size,
            prompt_len=ns.max_prompt_len, truncate=True, where=source,
            max_positions=target.config.max_position_embeddings,
            max_new_tokens=ns.max_new_tokens)
    if ns.limit:
        requests = requests[: ns.limit]
    return [list(r.prompt_ids) for r in requests]


def _rollouts(ns) -> None:
    from tev_jax.models import load_target, load_tokenizer
    from tev_jax.models.checkpoint_io import weights_fingerprint
    from tev_jax.sampling import Sampling
    from train.rollouts import RolloutConfig, make_rollouts, write_manifest
    from train.storage import require_local

    require_local(ns.out, "--out", "shards are written under temporary names and renamed "
                  "into place, which a bucket cannot do; write them to local disk or a "
                  "gcsfuse mount, then copy them up (gcloud storage cp -r)")
    require_local(ns.target, "--target", "copy it to local disk (gcloud storage cp -r) or "
                  "mount the bucket with gcsfuse, and pass that folder")
    if ns.merge:
        manifest = write_manifest(ns.out)
        print(f"wrote the manifest of {manifest['num_sequences']} sequences in "
              f"{len(manifest['shards'])} shards to {ns.out}")
        return
    if ns.target is None:
        raise ValueError("--target is required (except with --merge)")
    if ns.limit < 0:
        raise ValueError(f"--limit must be >= 0 (0: every prompt), got {ns.limit}")
    check_readable(ns.target, "--target", "target checkpoint folder", folder=True)
    check_readable(ns.tokenizer, "--tokenizer", "tokenizer file or folder")
    check_readable(ns.prompts_file, "--prompts-file", "prompts file", folder=False)
    stop = None if ns.stop_ids is None else _ints_flag(ns.stop_ids, "--stop-ids")
    if ns.target == BUNDLED:
        from tev_jax.models.bundled import bundled_paths

        ns.target = str(bundled_paths().target)
    index, count = ns.process_index, ns.process_count
    if ns.distributed:
        import jax

        jax.distributed.initialize()
        index, count = jax.process_index(), jax.process_count()
    target = load_target(ns.target, attention_window=ns.attention_window)
    tokenizer = load_tokenizer(ns.tokenizer or ns.target)
    prompts = _read_prompts(ns, tokenizer, target)
    stop = tuple(target.config.eos_token_ids) if stop is None else stop
    vocab = target.config.vocab_size
    for flag, ids in (("--pad-id", (ns.pad_id,)), ("--stop-ids", stop)):
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"{flag} {bad[0]} is outside the target's vocabulary [0, {vocab})")
    rc = RolloutConfig(max_prompt_len=ns.max_prompt_len, max_new_tokens=ns.max_new_tokens,
                       sampling=Sampling(ns.temperature, ns.top_k, ns.top_p),
                       stop_token_ids=stop, batch_size=ns.batch_size,
                       shard_size=ns.shard_size, pad_id=ns.pad_id, seed=ns.seed)
    from tqdm import tqdm

    mine = sum(len(prompts[i * ns.shard_size:(i + 1) * ns.shard_size])
               for i in range(index, -(-len(prompts) // ns.shard_size), count))
    bar = tqdm(total=mine, unit="seq", desc="rollouts", file=sys.stderr, smoothing=0)
    progress = bar.update

    info = {"target": str(ns.target), "target_fingerprint": weights_fingerprint(ns.target)}
    try:
        manifest = make_rollouts(target, prompts, ns.out, rc, info=info, progress=progress,
                                 process_index=index, process_count=count, replace=ns.force)
    except KeyboardInterrupt as e:
        from tev_jax.runtime.exit_codes import Interrupted

        done = len(list(Path(ns.out).glob("shard-*-of-*.json")))
        raise Interrupted(f"{done} complete shard(s) of --shard-size {ns.shard_size} are in "
                          f"{ns.out}: run the same command again to resume") from e
    finally:
        bar.close()
    if manifest is None:
        print(f"process {index}/{count}: wrote its shards to {ns.out}; the last process "
              "to finish writes the manifest (or run with --merge)")
    else:
        print(f"wrote {manifest['num_sequences']} sequences of length "
              f"{manifest['seq_len']} to {ns.out}")


def _run(ns) -> int:
    from tev_jax.runtime.locks import lock_output
    from tev_jax.runtime.exit_codes import (EXIT_RESUMABLE, Interrupted, Terminated,
                                            interrupt_exit)
    from train.checkpoint import steps_in
    from train.loop import train

    if ns.until_update is not None and ns.until_update < 1:
        raise ValueError(f"--until-update must be >= 1 (the update to stop after), got "
                         f"{ns.until_update}")
    if ns.max_minutes is not None and not 0 < ns.max_minutes < float("inf"):
        raise ValueError(f"--max-minutes must be a number > 0, got {ns.max_minutes}")
    check_readable(ns.config, "--config", "config file", folder=False)
    cfg = config_from_args(ns)  # refuses flags that contradict each other first
    for flag, name, what in (("--target-path", "target_path", "target checkpoint folder"),
                             ("--drafter-path", "drafter_path", "drafter checkpoint folder"),
                             ("--data-dir", "data_dir", "rollout folder")):
        check_readable(getattr(ns, name), flag, what, folder=True)  # as typed
    where = cfg.checkpoint_dir or str(Path(cfg.out_dir) / "checkpoints")
    # one run per --out-dir (on several hosts each process has its own view of it)
    lock = (contextlib.nullcontext() if cfg.distributed else
            lock_output(Path(cfg.out_dir) / "run", command=" ".join(sys.argv),
                        flag="--out-dir", what=cfg.out_dir))
    try:
        with lock:
            result = train(cfg, until_update=ns.until_update, max_minutes=ns.max_minutes,
                           progress=not ns.no_progress)
    except KeyboardInterrupt as e:
        steps = steps_in(where)
        if steps:
            raise Interrupted(f"the newest checkpoint, at update {steps[-1]}, is in {where}: "
                              "run the same command again to resume") from e
        raise Interrupted(f"no checkpoint was written yet ({where} is empty; the first comes "
                          f"at update {min(cfg.checkpoint_every, cfg.steps)}): the same "
                          "command starts the run again") from e
    ran = result.update - result.start_update
    lines = []
    if result.drafter_path:
        from tev_jax.models.bundled import is_bundled_target

        target = "" if is_bundled_target(cfg.target_path) else f"--target {cfg.target_path} "
        lines.append(f"drafter written to {result.drafter_path} (DFlash layout: tev-jax "
                     f"generate {target}--drafter {result.drafter_path})")
    if ran:
        last = result.history[-1] if result.history else {}
        speed = (f", {last['seq_tokens_per_s']:.0f} sequence tokens/s at the last update"
                 if last else "")
        lines.append(f"updates {result.start_update + 1}..{result.update} of {cfg.steps} in "
                     f"{result.seconds:.1f} s (compilation included): "
                     f"{ran / result.seconds:.2f} updates/s{speed}")
        if last:
            keys = [k for k in ("loss", "token_loss", "exit_loss", "tau", "opd_response",
                                "opd_rejected", "token_acc", "rollout_tau")
                    if k in last]
            at = "final" if result.update >= cfg.steps else "last"
            lines.append(f"{at} (update {int(last['update'])}): " + ", ".join(
                f"{k} {last[k]:.4g}" for k in keys) + f"; log in {cfg.out_dir}/train_log.jsonl")
    else:
        lines.append(f"nothing to do: the checkpoint in {where} is at update "
                     f"{result.update} of {cfg.steps}")
    if result.update < cfg.steps and not result.preempted:
        lines.append(f"stopped at update {result.update} of {cfg.steps} as asked: checkpoint "
                     f"in {where}; run the same command to continue")
    print("\n".join(lines))
    if result.preempted:
        what, _ = interrupt_exit(Terminated() if result.stop_signal == signal.SIGTERM
                                 else KeyboardInterrupt())
        what = what.replace("terminated", "preempted")
        print(f"{prog_name()} run: {what} at update {result.update}: checkpoint saved in {where}; "
              "run the same command again to resume", file=sys.stderr)
        return EXIT_RESUMABLE
    return 0


def _check_plan_flags(ns) -> tuple[float, ...]:
    """The plan flags checked before anything is compiled (one line naming the flag);
    -> the score capacities."""
    from tev_jax.sharding import TARGET_SHARDINGS
    from train.config import LOSSES, OBJECTIVES
    from train.step import DTYPES, REMAT

    for flag in ("drafter_layers", "num_taps", "batch", "seq_len", "anchors", "budget",
                 "mesh_data", "mesh_fsdp", "mesh_tensor", "rollout_batch",
                 "rollout_prompt_len", "rollout_new_tokens"):
        if getattr(ns, flag) is not None and getattr(ns, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got "
                             f"{getattr(ns, flag)}")
    if ns.block_size < 2:
        raise ValueError(f"--block-size must be >= 2, got {ns.block_size}")
    if ns.target_layers is not None and ns.target_layers < 1:
        raise ValueError(f"--target-layers must be >= 1, got {ns.target_layers}")
    if ns.host_devices < 0:
        raise ValueError(f"--host-devices must be >= 0 (0: the local devices), got "
                         f"{ns.host_devices}")
    for flag, allowed in (("target_dtype", DTYPES), ("param_dtype", DTYPES),
                          ("compute_dtype", DTYPES + (None,)), ("loss", LOSSES),
                          ("objective", OBJECTIVES),
                          ("target_sharding", TARGET_SHARDINGS), ("remat", tuple(REMAT))):
        if getattr(ns, flag) not in allowed:
            names = ", ".join(a for a in allowed if a is not None)
            raise ValueError(f"--{flag.replace('_', '-')} must be one of {names}, got "
                             f"{getattr(ns, flag)!r}")
    try:
        return tuple(float(c) for c in ns.score_capacities.split(",") if c)
    except ValueError:
        raise ValueError(f"--score-capacities takes comma-separated fractions, got "
                         f"{ns.score_capacities!r}") from None


def _plan_mesh_shape(ns) -> tuple[int, int, int]:
    """(data, fsdp, tensor) of the plan flags, checked against the devices before anything
    compiles; an unset --mesh-fsdp takes every device the other axes leave."""
    if ns.topology and ns.gpu:
        raise ValueError("plan for one of a TPU slice (--topology) or GPUs (--gpu), not both")
    if ns.topology or ns.gpu:
        if ns.topology:
            from tev_jax.costs.chips import slice_devices

            devices, what = len(slice_devices(ns.topology).devices), f"--topology {ns.topology}"
        else:
            from tev_jax.costs.chips import gpu_devices

            devices, what = len(gpu_devices(ns.gpu).devices), f"--gpu {ns.gpu}"
    else:
        import jax

        devices, what = jax.device_count(), "the local devices"
    other = ns.mesh_data * ns.mesh_tensor
    fsdp = ns.mesh_fsdp if ns.mesh_fsdp is not None else max(devices // other, 1)
    if ns.mesh_data * fsdp * ns.mesh_tensor > devices:
        hint = ("" if ns.topology or ns.gpu else " (on CPU simulate devices with "
                "--host-devices N or XLA_FLAGS=--xla_force_host_platform_device_count=N)")
        need = ns.mesh_data * fsdp * ns.mesh_tensor
        raise ValueError(f"the mesh --mesh-data {ns.mesh_data} x --mesh-fsdp {fsdp} x "
                         f"--mesh-tensor {ns.mesh_tensor} needs {need} devices; {what} have "
                         f"{devices}{hint}")
    return ns.mesh_data, fsdp, ns.mesh_tensor


def _plan(ns) -> None:
    import os

    capacities = _check_plan_flags(ns)
    if ns.host_devices:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={ns.host_devices}")
    from tev_jax.costs.plan import PRESETS
    from train.plan import plan_rollouts, plan_step, target_config_from

    if ns.target not in PRESETS and not os.path.exists(ns.target):
        raise ValueError(f"--target {ns.target}: neither a preset "
                         f"({', '.join(sorted(PRESETS))}) nor a config.json or its folder")
    target_config = target_config_from(ns.target, ns.target_layers)
    mesh_shape = _plan_mesh_shape(ns)
    where = (f"the TPU slice {ns.topology}" if ns.topology else
             f"the GPUs {ns.gpu}" if ns.gpu else "the local devices")
    mesh_s = " x ".join(f"{a} {n}" for a, n in zip(("data", "fsdp", "tensor"), mesh_shape))
    print(f"compiling one training step of --target {ns.target} on {where}, mesh {mesh_s} "
          "(minutes for a large model) ...", file=sys.stderr, flush=True)
    plan = plan_step(
        target_config, drafter_layers=ns.drafter_layers,
        num_taps=ns.num_taps, block_size=ns.block_size, batch=ns.batch, seq_len=ns.seq_len,
        anchors=ns.anchors, budget=ns.budget, loss=ns.loss, objective=ns.objective,
        mesh_shape=mesh_shape, target_dtype=ns.target_dtype,
        param_dtype=ns.param_dtype, compute_dtype=ns.compute_dtype,
        target_sharding=ns.target_sharding, remat=ns.remat,
        score_capacities=capacities, topology=ns.topology, gpu=ns.gpu)
    if ns.objective != "opd":
        print(json.dumps(plan.to_dict()) if ns.json else plan.format())
        return
    rollouts = plan_rollouts(
        target_config, drafter_layers=ns.drafter_layers, block_size=ns.block_size,
        budget=ns.budget, builder=ns.rollout_builder, temperature=ns.rollout_temperature,
        batch=ns.rollout_batch, prompt_len=ns.rollout_prompt_len,
        max_new_tokens=ns.rollout_new_tokens,
        mesh_shape=mesh_shape,
        target_dtype=ns.target_dtype, topology=ns.topology, gpu=ns.gpu)
    if ns.json:
        print(json.dumps({**plan.to_dict(), "rollouts": rollouts.as_dict()}))
    else:
        print(plan.format() + "\nrollout programs (batch "
              f"{ns.rollout_batch}, prompts <= {ns.rollout_prompt_len}, "
              f"{ns.rollout_new_tokens} new tokens: one prefill per batch, up to that many "
              "rounds):\n" + rollouts.format())


def prog_name() -> str:
    """How the user called the command, for its messages."""
    return "tev-train" if Path(sys.argv[0]).name == "tev-train" else "python -m train"


def build_parser() -> argparse.ArgumentParser:
    from tev_jax import __version__
    from train.config import RECIPES

    p = argparse.ArgumentParser(prog=prog_name(), description=DESCRIPTION)
    p.add_argument("--version", action="version", version=f"tev-train {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    p.set_defaults(subcommands=sub)  # main shows a subcommand's usage for its flag typos

    r = sub.add_parser("rollouts", help="generate target responses to prompts",
                       description="The target answers every prompt (autoregressive "
                                   "decoding); the [prompt ; answer] token rows go to .npy "
                                   "shards in --out, the drafter's training data.")
    r.add_argument("--target", help="Hugging Face target directory, or 'bundled' (the "
                                    "bundled demo target)")
    r.add_argument("--tokenizer", help="tokenizer.json or its directory (default: --target)")
    r.add_argument("--attention-window", choices=("native", "full"), default="native",
                   help="a sliding-window target's (Gemma 4) sliding layers: 'native' as "
                        "trained, or 'full' every layer global (default %(default)s)")
    r.add_argument("--prompts-file",
                   help="a prompts file as for tev-jax generate --prompts: JSONL records "
                        "with prompt / messages / prompt_ids (ids optional here) or plain "
                        "text, one prompt per line")
    r.add_argument("--prompt-set", action="append",
                   help="a bundled prompt set (evaluation data: its rollouts leak it into "
                        "the drafter); repeatable")
    r.add_argument("--limit", type=int, default=0,
                   help="use only the first N prompts (0, the default: every prompt)")
    r.add_argument("--out", required=True, help="the rollout folder to write")
    r.add_argument("--force", action="store_true",
                   help="replace rollouts of other settings in --out (default: refuse them)")
    r.add_argument("--max-prompt-len", type=int, default=256,
                   help="keep the last this many tokens of a prompt (default %(default)s)")
    r.add_argument("--max-new-tokens", type=int, default=256,
                   help="answer length cap (default %(default)s)")
    r.add_argument("--temperature", type=float, default=1.0,
                   help="the target's sampling temperature (default %(default)s)")
    r.add_argument("--top-k", type=int, help="sampling: keep the k best tokens")
    r.add_argument("--top-p", type=float, help="sampling: nucleus mass")
    r.add_argument("--stop-ids", help="comma-separated (default: the target's eos ids)")
    r.add_argument("--batch-size", type=int, default=16,
                   help="prompts decoded together (default %(default)s)")
    r.add_argument("--shard-size", type=int, default=4096,
                   help="sequences per shard (default %(default)s)")
    r.add_argument("--pad-id", type=int, default=0, help="padding token id (default 0)")
    r.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    r.add_argument("--process-index", type=int, default=0,
                   help="this process writes the shards i with i %% count == index")
    r.add_argument("--process-count", type=int, default=1,
                   help="processes writing the set (default 1)")
    r.add_argument("--distributed", action="store_true",
                   help="index and count from jax.distributed.initialize()")
    r.add_argument("--merge", action="store_true",
                   help="only write the manifest of the shards in --out")
    r.set_defaults(fn=_rollouts)

    t = sub.add_parser("run", help="train a drafter (resumes from --out-dir)",
                       description="Trains a DFlash drafter: --objective token (the token "
                                   "loss on the rollouts), exittrain (+ the ExitTrain tree "
                                   "term) or opd (Draft-OPD on the drafter's own "
                                   "speculative rounds of the rollouts' prompts); resumes "
                                   "from the newest good checkpoint of --out-dir (or "
                                   "--checkpoint-dir).")
    t.add_argument("--recipe", choices=sorted(RECIPES),
                   help="start from a named preset of TrainConfig fields (paper: the "
                        "authors' ExitTrain recipe)")
    t.add_argument("--config", help="JSON file of TrainConfig fields (over --recipe)")
    _add_config_flags(t)
    t.add_argument("--until-update", type=int, help="stop (with a checkpoint) after this update")
    t.add_argument("--max-minutes", type=float, help="stop (with a checkpoint) after this time")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(fn=_run)

    pl = sub.add_parser("plan", help="per-device memory of a training step (no weights)")
    pl.add_argument("--target", required=True,
                    help="a preset (tev_jax.costs.plan.PRESETS) or an HF config.json / directory")
    pl.add_argument("--target-layers", type=int, help="cut the target to this many layers")
    pl.add_argument("--drafter-layers", type=int, default=1,
                    help="the drafter's layers (default %(default)s)")
    pl.add_argument("--num-taps", type=int, default=5, help="target layers the drafter reads")
    pl.add_argument("--block-size", type=int, default=16,
                    help="the drafter's block size (default %(default)s)")
    pl.add_argument("--batch", type=int, default=8, help="B sequences (global)")
    pl.add_argument("--seq-len", type=int, default=2048,
                    help="L tokens per sequence (default %(default)s)")
    pl.add_argument("--anchors", type=int, default=32,
                    help="A anchors per sequence (default %(default)s)")
    pl.add_argument("--budget", type=int, default=32,
                    help="DDTree budget of the training trees (default %(default)s)")
    pl.add_argument("--objective", default="exittrain",
                    help="token, exittrain or opd, as tev-train run --objective (default "
                         "%(default)s); opd also plans the rollout programs")
    pl.add_argument("--loss", default="exit", help="as tev-train run --loss (default exit)")
    pl.add_argument("--rollout-batch", type=int, default=8,
                    help="opd: prompts decoded together (default %(default)s)")
    pl.add_argument("--rollout-prompt-len", type=int, default=256,
                    help="opd: the rollouts' prompt buffer (default %(default)s)")
    pl.add_argument("--rollout-new-tokens", type=int, default=256,
                    help="opd: the rollouts' response cap (default %(default)s)")
    pl.add_argument("--rollout-builder", default="ddtree",
                    help="opd: the rollouts' tree builder (default %(default)s)")
    pl.add_argument("--rollout-temperature", type=float, default=0.0,
                    help="opd: the rollouts' temperature (default %(default)s)")
    pl.add_argument("--mesh-data", type=int, default=1,
                    help="devices on the data axis (default %(default)s)")
    pl.add_argument("--mesh-fsdp", type=int, default=None,
                    help="devices on the fsdp axis (default: every device the data and "
                         "tensor axes leave, of --topology / --gpu or the local devices)")
    pl.add_argument("--mesh-tensor", type=int, default=1,
                    help="devices on the tensor axis (default %(default)s)")
    pl.add_argument("--target-dtype", default="float32",
                    help="the frozen target's dtype (default %(default)s)")
    pl.add_argument("--param-dtype", default="float32",
                    help="the drafter's master weights (default %(default)s)")
    pl.add_argument("--compute-dtype", help="default: param dtype")
    pl.add_argument("--target-sharding", default="fsdp",
                    help="fsdp or replicated (default %(default)s)")
    pl.add_argument("--remat", default="none", help="none, full or dots (default none)")
    pl.add_argument("--score-capacities", default="", help="comma-separated fractions")
    pl.add_argument("--topology", default=None, metavar="NAME",
                    help="plan for a TPU slice (e.g. v5p:2x2x2, v5e:4x4; needs the tpu "
                         "extra and JAX_PLATFORMS=cpu off TPU) instead of the local devices")
    pl.add_argument("--gpu", default=None, metavar="NAME",
                    help="plan for NVIDIA GPUs (e.g. h100x8, h200x8; needs the gpu extra) "
                         "instead of the local devices")
    pl.add_argument("--host-devices", type=int, default=0,
                    help="simulate this many CPU devices (sets XLA_FLAGS; CPU only)")
    pl.add_argument("--json", action="store_true", help="print one JSON record")
    pl.set_defaults(fn=_plan)
    return p


def main(argv=None) -> int:
    """The ``tev-train`` command; the exit codes are in the module docstring. SIGINT and
    SIGTERM are recorded from the first line on (`tev_jax.runtime.signals`) and taken at safe points:
    between updates (``run`` saves a checkpoint), shards (``rollouts``) or at the end."""
    from tev_jax.runtime import signals

    with signals.handled_signals("tev-train"):
        return _main(argv)


def run() -> None:
    """The ``tev-train`` executable: `main`, then exit with its code; a signal while the
    interpreter exits (a checkpoint is complete by then) ends it with that code at once
    (`tev_jax.runtime.signals.exit_quietly`), never with a traceback."""
    from tev_jax.runtime import signals

    try:
        code = main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 2
    signals.exit_quietly(code)
    sys.exit(code)


def _main(argv) -> int:
    from tev_jax.runtime import signals
    from tev_jax.runtime.exit_codes import (EXIT_RESUMABLE, EXIT_USAGE, Interrupted,
                                            flag_names, interrupt_exit, name_flags,
                                            parse_args)

    prog, command = prog_name(), None
    try:
        from tev_jax.runtime.platforms import quiet_start

        quiet_start()  # before jax is imported: no libtpu / CUDA plugin lines on a CPU
        parser = build_parser()
        signals.check()
        ns = parse_args(parser, parser.get_default("subcommands"), argv)
        command = ns.command
        if getattr(ns, "distributed", False) in (True, "true"):
            # jax's preemption sync takes SIGTERM in every process; Ctrl-C is Python's
            signals.release(signal.SIGTERM)
            signals.release(signal.SIGINT)
        signals.check()
        from train.checkpoint import CheckpointError

        try:
            code = ns.fn(ns) or 0
        except CheckpointError as e:
            raise ValueError(str(e)) from None
        if code == 0:
            signals.note_late(f"{prog} {command}")  # one its last stretch did not take
        return code
    except KeyboardInterrupt as e:
        name = f"{prog} {command}" if command else prog
        what, code = interrupt_exit(e.__cause__ if isinstance(e, Interrupted) else e)
        if isinstance(e, Interrupted):
            print(f"{name}: {what}; {e}", file=sys.stderr)
            return EXIT_RESUMABLE
        if command in ("run", "rollouts"):  # before it started: a rerun starts it
            print(f"{name}: {what} before anything was written: run the same command "
                  "again to start it", file=sys.stderr)
            return EXIT_RESUMABLE
        print(f"{name}: {what}", file=sys.stderr)
        return code
    except ValueError as e:
        print(f"{prog} {command}: error: {name_flags(str(e), flag_names(parser))}",
              file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        print(f"{prog} {command}: error: {where}{e.strerror or e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    run()
