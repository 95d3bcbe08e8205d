"""The training loop: batches, the jitted step, JSONL logs, a progress bar, checkpoints.

A run is a pure function of its `TrainConfig` and its data: the micro-batch ``m`` is
``data.batch_at(seed, m, ...)``, so a run killed at any point and resumed from its last
checkpoint replays exactly the same batches and (on CPU) the same losses bit for bit.
Each process reads only the batch rows of its own devices (`train.local_input`).
A Draft-OPD run (``objective='opd'``) takes its micro-batches from the rounds of its
current rollout phase instead (`train.opd_phases`: the batch of update k is a pure
function of the phase's rounds, the seed and k) and runs `train.opd_step`'s step.

Checkpoints are asynchronous orbax saves (`train.checkpoint`), to ``out_dir/checkpoints``
or ``checkpoint_dir`` (which may be ``gs://...``); on SIGTERM the run saves after the
current update and returns (`train.preemption`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tev_jax import sharding as shd
from tev_jax.exit_train import ExitTrainConfig
from train.anchors import anchor_range
from train.checkpoint import CheckpointError, TrainCheckpointer, set_aside, steps_in
from train.config import TrainConfig
from train.local_input import batch_rows, place_local_batch
from train.opd_phases import OpdPhases, run_key
from train.opd_step import OpdStepConfig, opd_program, place_opd_batch
from train.plan import check_step_fits, check_step_floor
from train.preemption import PreemptionWatch
from train.rollouts import RolloutSet
from train.storage import check_bucket, is_remote
from train.optimizer import OptimConfig
from train.placement import abstract_state, init_state, place_frozen
from train.state import merge_drafter, split_models
from train.step import StepConfig, step_program


@dataclasses.dataclass
class TrainResult:
    """What `train` returns.

    Attributes:
      state: the final `TrainState` (device arrays).
      history: one metrics dict per logged update (host floats).
      start_update: the update the run started from (> 0 when resumed).
      drafter: the trained drafter module (parameters merged back).
      preempted: the run stopped early on SIGTERM or SIGINT (with a checkpoint at its last
        update).
      stop_signal: which of the two stopped it (None when it was not preempted).
      update: the last update run.
      seconds: wall time of the updates this call ran (compilation included).
      drafter_path: where the drafter was written (``out_dir/drafter``), or None (the
        run stopped before ``steps``, or ``save_final_drafter`` was off).
    """

    state: Any
    history: list[dict[str, float]]
    start_update: int
    drafter: Any
    preempted: bool = False
    stop_signal: int | None = None
    update: int = 0
    seconds: float = 0.0
    drafter_path: str | None = None


def make_mesh_for(cfg: TrainConfig):
    """The ('data', 'fsdp', 'tensor') mesh of the config, or None for one device."""
    if cfg.mesh_shape == (1, 1, 1):
        return None
    return shd.make_mesh(data=cfg.mesh_data, fsdp=cfg.mesh_fsdp, tensor=cfg.mesh_tensor)


def load_models(cfg: TrainConfig, mesh=None):
    """(target, drafter) from the config's paths (a new drafter if no drafter_path).

    The target is loaded in ``target_dtype`` and placed by ``target_sharding``; the
    drafter's parameters in ``param_dtype`` (the master weights the step updates).
    """
    from tev_jax.models import load_target
    from tev_jax.models.drafter_io import init_drafter, load_drafter

    if cfg.target_path is None:
        raise ValueError("target_path is required (a Hugging Face checkpoint directory)")
    target_dtype, param_dtype, _ = (jnp.dtype(d) for d in cfg.dtypes)
    target = load_target(cfg.target_path, dtype=target_dtype, mesh=mesh,
                         rules=None if mesh is None else
                         shd.frozen_target_rules(cfg.target_sharding),
                         attention_window=cfg.attention_window)
    if cfg.drafter_path is not None:
        drafter = load_drafter(cfg.drafter_path, target, dtype=param_dtype, mesh=mesh)
    else:
        layers = target.config.num_layers
        bad = [i for i in cfg.target_layer_ids or () if not 0 <= i < layers]
        if bad:
            raise ValueError(f"--target-layer-ids {','.join(map(str, bad))}: the target "
                             f"{cfg.target_path} has layers 0..{layers - 1}")
        mask = cfg.mask_token_id if cfg.mask_token_id is not None else _mask_id(cfg.target_path)
        drafter = init_drafter(target, num_layers=cfg.drafter_layers, block_size=cfg.block_size,
                               mask_token_id=mask, key=cfg.seed,
                               target_layer_ids=cfg.target_layer_ids, dtype=param_dtype)
    return target, drafter


def _mask_id(target_path: str) -> int:
    """The id of ``<|mask|>`` in the target's tokenizer (the bundled tokenizer has one)."""
    from tev_jax.data.tokenizer import MASK
    from tev_jax.models import load_tokenizer

    try:
        mask = load_tokenizer(target_path).token_to_id(MASK)
    except ValueError:
        mask = None
    if mask is None:
        raise ValueError(f"a new drafter needs mask_token_id: the target at {target_path} has "
                         f"no tokenizer with a {MASK} token (DFlash drafters of Qwen3 use "
                         "the id listed in their dflash_config)")
    return int(mask)


def exit_train_config(cfg: TrainConfig) -> ExitTrainConfig:
    """The objective's settings of a run."""
    return ExitTrainConfig(loss=cfg.exittrain_loss, budget=cfg.budget,
                           exit_lambda=cfg.exit_lambda, sampling=cfg.sampling,
                           decay_gamma=cfg.token_decay_gamma,
                           exit_normalizer=cfg.exit_normalizer, exit_floor=cfg.exit_floor,
                           tree_metrics=cfg.tree_metrics,
                           score_capacities=cfg.score_capacities,
                           prefix_window=cfg.exit_prefix_window)


def step_config(cfg: TrainConfig, drafter) -> StepConfig:
    """The step's settings of a run with ``drafter`` (its taps and horizon)."""
    dc = drafter.config
    _, param_dtype, compute_dtype = cfg.dtypes
    return StepConfig(objective=exit_train_config(cfg), taps=tuple(dc.target_layer_ids),
                      horizon=dc.horizon,
                      compute_dtype=None if compute_dtype == param_dtype else compute_dtype,
                      remat=cfg.remat, target_sharding=cfg.target_sharding)


def opd_step_config(cfg: TrainConfig, drafter) -> OpdStepConfig:
    """The OPD step's settings of an opd run with ``drafter``."""
    dc = drafter.config
    _, param_dtype, compute_dtype = cfg.dtypes
    return OpdStepConfig(opd=cfg.opd_config, taps=tuple(dc.target_layer_ids),
                         horizon=dc.horizon,
                         compute_dtype=None if compute_dtype == param_dtype else compute_dtype,
                         remat=cfg.remat, target_sharding=cfg.target_sharding)


def opd_phases(cfg: TrainConfig, target, data: RolloutSet, mesh, progress: bool) -> OpdPhases:
    """The rollout phases of an opd run (its drafter merge is set once the frozen state
    is placed)."""
    stop = tuple(target.config.eos_token_ids or ())
    return OpdPhases(cfg, target, data, merge=None, mesh=mesh,
                     run_key=run_key(cfg.run_fingerprint(), data.fingerprint()),
                     stop_token_ids=stop, progress=progress)


def optim_config(cfg: TrainConfig) -> OptimConfig:
    return OptimConfig(lr=cfg.lr, steps=cfg.steps, warmup_steps=cfg.warmup_steps,
                       end_lr_ratio=cfg.end_lr_ratio, weight_decay=cfg.weight_decay,
                       b1=cfg.b1, b2=cfg.b2, grad_clip=cfg.grad_clip,
                       grad_accum=cfg.grad_accum)


def _check_resume(meta: dict, cfg: TrainConfig, data: RolloutSet, step: int, ckdir):
    want = cfg.run_fingerprint()
    got = meta.get("config", {})
    diff = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
    if diff:
        detail = ", ".join(f"{k}: checkpoint {got.get(k)!r} vs now {want.get(k)!r}" for k in diff)
        raise ValueError(f"cannot resume from step {step} in {ckdir}: the config differs "
                         f"({detail}); use another out_dir or resume=False (the earlier "
                         "checkpoints are then moved aside)")
    if meta.get("data") != data.fingerprint():
        raise ValueError(f"cannot resume from step {step} in {ckdir}: the data differs "
                         f"(checkpoint {meta.get('data')}, now {data.fingerprint()})")


def check_data_target(data: RolloutSet, target_path: str | None, data_dir=None) -> None:
    """Refuses rollouts that another target generated (their manifest records the
    generating target's `tev_jax.models.checkpoint_io.weights_fingerprint`; older sets
    without one are not checked)."""
    from tev_jax.models.checkpoint_io import weights_fingerprint

    info = data.manifest.get("info") or {}
    want = info.get("target_fingerprint")
    if want is None or target_path is None:
        return
    got = weights_fingerprint(target_path)
    if got != want:
        raise ValueError(f"the rollouts in data_dir={data_dir} were generated by another "
                         f"target ({info.get('target')}, fingerprint {want}) than "
                         f"target_path={target_path} ({got}); a drafter learns its own "
                         "target's outputs: make rollouts with this target")


def check_anchors(data: RolloutSet, horizon: int, partial: bool, data_dir=None,
                  num_anchors: int | None = None) -> None:
    """Refuses rollouts in which no sequence has a valid anchor (`train.anchors`): every
    loss would be 0 and the drafter would learn nothing; and ``num_anchors`` above the
    anchor positions a sequence of the data's length has (they could only be padding)."""
    spans = data.spans
    counts = [hi - lo for lo, hi in (anchor_range(int(a), int(b), horizon, partial)
                                     for a, b in spans)]
    if max(counts) <= 0:
        longest = int((spans[:, 1] - spans[:, 0]).max())
        need = 1 if partial else horizon
        raise ValueError(f"the rollouts in data_dir={data_dir} have no anchor to train on: "
                         f"the longest response has {longest} tokens, and block_size="
                         f"{horizon + 1} needs at least {need}; make longer rollouts "
                         "(--max-new-tokens) or lower --block-size")
    lo, hi = anchor_range(0, data.seq_len, horizon, partial)
    if num_anchors is not None and num_anchors > hi - lo:
        raise ValueError(f"num_anchors ({num_anchors}) is more than the anchor positions of "
                         f"a sequence of data_dir={data_dir} ({hi - lo} in "
                         f"{data.seq_len} tokens with block_size={horizon + 1}); use at "
                         f"most {hi - lo}")


def _set_aside(directory) -> None:
    """Moves an earlier run's checkpoints aside for a run that starts over (process 0;
    every process waits for it)."""
    moved = None
    if jax.process_index() == 0:
        moved = set_aside(directory)
        if moved is not None:
            print(f"resume=False: moved the earlier run's checkpoints (steps {moved[0]}) "
                  f"from {directory} to {moved[1]}", file=sys.stderr)
    _barrier("tev-train set aside")


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _resume(ckpt: TrainCheckpointer, abstract, cfg: TrainConfig, data: RolloutSet):
    """(state, update) of the newest checkpoint that restores, or (None, 0) without one.

    An unreadable or incomplete newer checkpoint is moved aside (to
    ``unreadable-<step>-<time>`` in the same folder, so later saves can use its step)
    with one line saying which and why; a checkpoint of another config or data is
    refused, as is a folder where no checkpoint restores.
    """
    failed = []
    for step in reversed(ckpt.all_steps()):
        try:
            state, meta, start = ckpt.restore(abstract, step)
        except CheckpointError as e:
            failed.append((step, e))
            continue
        _check_resume(meta, cfg, data, start, ckpt.directory)
        if int(state.step) != start * cfg.grad_accum:
            raise CheckpointError(f"checkpoint step {start} in {ckpt.directory} holds "
                                  f"micro-step {int(state.step)}, expected "
                                  f"{start * cfg.grad_accum}")
        if failed:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            if jax.process_index() == 0:
                for bad, _ in failed:
                    (ckpt.directory / str(bad)).rename(
                        ckpt.directory / f"unreadable-{bad}-{stamp}")
                print(f"resuming from step {start}, the newest checkpoint that restores; "
                      f"moved aside as unreadable-<step>-{stamp}: {failed[0][1]}",
                      file=sys.stderr)
            _barrier("tev-train resume")
            ckpt.all_steps()
        return state, start
    if failed:
        raise CheckpointError(
            f"no checkpoint in {ckpt.directory} restores (steps {[s for s, _ in failed]}; "
            f"the newest: {failed[0][1]}); start over with resume=False (it moves them "
            "aside)")
    return None, 0


def _write_config(out: Path, cfg: TrainConfig) -> None:
    """``out_dir/config.json``: the settings of the run that trains now (process 0;
    written once the run has passed its checks)."""
    if jax.process_index() == 0:
        tmp = out / f".config.json.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(cfg.to_dict(), indent=2))
        os.replace(tmp, out / "config.json")


def _truncate_log(path: Path, upto: int) -> None:
    """Drops records after update ``upto`` (written by a run killed after its last
    checkpoint; the resumed run writes them again)."""
    if jax.process_index() != 0 or not path.exists():
        return
    keep = [r for r in read_log(path) if r.get("update", 0) <= upto]
    path.write_text("".join(json.dumps(r) + "\n" for r in keep))


def _write_log(path: Path, record: dict) -> None:
    if jax.process_index() == 0:
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def train(cfg: TrainConfig, *, target=None, drafter=None, data: RolloutSet | None = None,
          until_update: int | None = None, max_minutes: float | None = None,
          progress: bool = True, save_final_drafter: bool = True) -> TrainResult:
    """Trains the drafter; resumes from the newest checkpoint that restores.

    Every check (models, data against its target, the checkpoint's config and data)
    passes before ``out_dir/config.json`` is written. A checkpoint that cannot be read
    is moved aside with one line on stderr and the one before it is used; with
    ``cfg.resume`` False an earlier run's checkpoints are moved aside
    (`train.checkpoint.set_aside`). On SIGTERM (preemption; also SIGINT under ``tev-train``)
    it saves after the current update and returns with ``preempted=True``; calling it
    again resumes.

    Args:
      cfg: the `TrainConfig`.
      target, drafter, data: in-memory models and data (default: loaded from the
        config's paths).
      until_update: stop (with a checkpoint) after this update, as a preempted job
        would; a later call resumes.
      max_minutes: stop (with a checkpoint) after this wall time.
      progress: show a tqdm progress bar.
      save_final_drafter: write the drafter in the DFlash layout to ``out_dir/drafter``
        when the run reaches ``cfg.steps``.
    Returns:
      A `TrainResult`.
    """
    from tqdm.auto import tqdm

    out = Path(cfg.out_dir)
    ckdir = cfg.checkpoint_dir or out / "checkpoints"
    if is_remote(ckdir):
        check_bucket(ckdir)
    if cfg.resume is True and not steps_in(ckdir):
        raise ValueError(f"resume=True but {ckdir} holds no checkpoint: is out_dir "
                         f"({cfg.out_dir}) mistyped? Drop resume=True to start a new run there")
    if cfg.distributed:
        jax.distributed.initialize()
    mesh = make_mesh_for(cfg)
    loaded = target is None or drafter is None
    if loaded:
        target, drafter = load_models(cfg, mesh)
    if data is None:
        if cfg.data_dir is None:
            raise ValueError("data_dir is required (rollouts from `python -m train rollouts`)")
        data = RolloutSet.load(cfg.data_dir)
    if loaded:
        check_data_target(data, cfg.target_path, cfg.data_dir)
    horizon = drafter.config.horizon
    opd = cfg.objective == "opd"
    if not opd and data.seq_len <= horizon + 1:
        raise ValueError(f"sequences of length {data.seq_len} are too short for block size "
                         f"{drafter.config.block_size}")
    if not opd:
        check_anchors(data, horizon, cfg.partial_anchors, cfg.data_dir, cfg.num_anchors)

    log_path = out / "train_log.jsonl"
    scfg = step_config(cfg, drafter)
    check_step_floor(cfg, seq_len=data.seq_len, taps=len(scfg.taps),  # shapes, at once
                     width=target.config.hidden_size, mesh=mesh,
                     itemsize=jax.tree.leaves(nnx.state(target, nnx.Param))[0].dtype.itemsize)
    graphs, frozen, params = split_models(target, drafter)
    _, param_state, _ = nnx.split(drafter, nnx.Param, ...)
    phases = None
    if opd:   # Draft-OPD: rollout phases of the drafter's own rounds (train.opd_phases)
        phases = opd_phases(cfg, target, data, mesh, progress)
        batch_shape = (cfg.batch_size, phases.plan.seq_len, cfg.num_anchors)
        program = opd_program(graphs, opd_step_config(cfg, drafter), optim_config(cfg), mesh,
                              param_state, frozen, batch_shape)
    else:
        batch_shape = (cfg.batch_size, data.seq_len, cfg.num_anchors)
        program = step_program(graphs, scfg, optim_config(cfg), mesh, param_state, frozen,
                               batch_shape)
    place, optimizer, step_fn = program.place, program.optimizer, program.step_fn
    frozen = place_frozen(frozen, place)
    if not opd:  # the step's compiled memory, before anything is written (jax keeps the
        # compile: the first update does not compile again)
        first = place_local_batch(data.batch_at(
            cfg.seed, 0, cfg.batch_size, cfg.num_anchors, horizon,
            rows=batch_rows(place, batch_shape), partial=cfg.partial_anchors),
            place, batch_shape)
        with place.context():
            lowered = step_fn.lower(abstract_state(params, optimizer, place), first, frozen)
        check_step_fits(lowered, cfg, mesh)
    if phases is not None:
        phases.merge = lambda p: merge_drafter(graphs, frozen, p)

    if cfg.resume is False:
        _set_aside(ckdir)
        if phases is not None:
            phases.set_aside()
    ckpt = TrainCheckpointer(ckdir, every=cfg.checkpoint_every, keep=cfg.keep_checkpoints,
                             async_save=True)
    state, start = (None, 0)
    try:
        if cfg.resume is not False:
            state, start = _resume(ckpt, abstract_state(params, optimizer, place), cfg, data)
    except BaseException:
        ckpt.close()
        raise
    if state is None:
        if jax.process_index() == 0:
            print(f"starting a new run in {out} (no checkpoint there yet)", file=sys.stderr)
        state = init_state(params, optimizer, place)
    elif jax.process_index() == 0:
        print(f"resuming the run in {out} from its checkpoint at update {start} of "
              f"{cfg.steps}", file=sys.stderr)
    del params
    if jax.process_index() == 0:
        out.mkdir(parents=True, exist_ok=True)
    _write_config(out, cfg)
    _truncate_log(log_path, start)

    meta_base = {"config": cfg.run_fingerprint(), "data": data.fingerprint(),
                 "drafter": drafter.config.to_hf()}
    stop = cfg.steps if until_update is None else min(cfg.steps, until_update)
    rows = None if opd else batch_rows(place, batch_shape)
    history: list[dict[str, float]] = []
    bar = tqdm(total=cfg.steps, initial=start, disable=not progress,
               desc=f"train[{cfg.objective}]")
    t_start = time.perf_counter()
    t_last, n_since = time.perf_counter(), 0
    update, preempted, stop_signal = start, False, None
    try:
        with place.context(), PreemptionWatch(ckpt) as preemption:
            while update < stop:
                if phases is not None:
                    buffer = phases.buffer_at(update, state.params)
                for i in range(cfg.grad_accum):
                    micro = update * cfg.grad_accum + i
                    if phases is not None:
                        batch = place_opd_batch(buffer.batch_at(
                            cfg.seed, micro, cfg.batch_size, cfg.num_anchors), program)
                    else:
                        batch = place_local_batch(data.batch_at(
                            cfg.seed, micro, cfg.batch_size, cfg.num_anchors, horizon,
                            rows=rows, partial=cfg.partial_anchors), place, batch_shape)
                    state, metrics = step_fn(state, batch, frozen)
                update += 1
                n_since += 1
                if update % cfg.log_every == 0 or update == stop:
                    host = {k: float(v) for k, v in jax.device_get(metrics).items()}
                    now = time.perf_counter()
                    dt = (now - t_last) / n_since
                    t_last, n_since = now, 0
                    host.update(update=update, step_seconds=dt,
                                seq_tokens_per_s=cfg.batch_size * batch_shape[1]
                                * cfg.grad_accum / dt)
                    if phases is not None:
                        host.update(phases.metrics())
                    history.append(host)
                    _write_log(log_path, host)
                    bar.set_postfix({k: f"{host[k]:.4g}" for k in ("loss", "tau") if k in host})
                    if not math.isfinite(host["loss"]):
                        raise FloatingPointError(f"non-finite loss {host['loss']} at update "
                                                 f"{update}")
                bar.update(1)
                out_of_time = max_minutes is not None and _on_process_0(
                    time.perf_counter() - t_start > 60 * max_minutes)
                preempted = preemption.reached(update)
                last = update == stop or out_of_time or preempted
                saved = ckpt.save(update, state, {**meta_base, "update": update,
                                                  "micro_step": update * cfg.grad_accum},
                                  force=last)
                if saved and phases is not None:
                    phases.prune(ckpt.all_steps() + [update])   # this one may be in flight
                if cfg.drafter_every and update % cfg.drafter_every == 0 and update < cfg.steps:
                    _save_drafter(merge_drafter(graphs, frozen, state.params),
                                  out / "drafters" / f"update-{update}")
                if out_of_time or preempted:
                    stop_signal = preemption.signal if preempted else None
                    break
    finally:  # also on Ctrl-C: a save in flight commits before the process ends
        bar.close()
        ckpt.close()
    seconds = time.perf_counter() - t_start

    drafter_out = merge_drafter(graphs, frozen, state.params)
    drafter_path = None
    if save_final_drafter and update >= cfg.steps:
        _save_drafter(drafter_out, out / "drafter")
        drafter_path = str(out / "drafter")
    return TrainResult(state=state, history=history, start_update=start, drafter=drafter_out,
                       preempted=preempted, stop_signal=stop_signal, update=update,
                       seconds=seconds, drafter_path=drafter_path)


def _on_process_0(flag: bool) -> bool:
    """Process 0's ``flag`` on every process (clocks differ; all must stop together)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag)))


def _save_drafter(drafter, path: Path) -> None:
    from tev_jax.models.drafter_io import save_drafter

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        graphdef, state = nnx.split(drafter)
        state = multihost_utils.process_allgather(state, tiled=True)
        drafter = nnx.merge(graphdef, state)
    if jax.process_index() == 0:
        save_drafter(drafter, path)


def read_log(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``train_log.jsonl``."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


__all__ = ["TrainResult", "check_anchors", "check_data_target", "load_models", "make_mesh_for", "read_log",
           "step_config", "train"]
