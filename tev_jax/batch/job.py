"""Batch generation from a prompts file: the job behind ``tev-jax generate --prompts``.

`generate_file` reads and checks every prompt before loading anything heavy, skips the
ids already in the output (a rerun resumes it), decodes the rest with continuous
batching (`tev_jax.batch.continuous`) and appends one JSON line per finished prompt
(`tev_jax.batch.outputs`). Several processes split one file: process i of n takes prompts
i, i + n, ... and writes ``OUT.<i>-of-<n>.jsonl`` (`tev_jax.batch.outputs.merge_outputs`
joins them).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from tev_jax import slots, text_io
from tev_jax.batch import continuous, outputs
from tev_jax.batch.rates import WindowRate
from tev_jax.budget import AutoBudget, check_tuned_for
from tev_jax.decode import DecodeConfig
from tev_jax.runtime.exit_codes import Interrupted
from tev_jax.sharding import MESH_AXES
from tev_jax.text_io import stop_token_ids


@dataclasses.dataclass(frozen=True)
class FileJob:
    """One batch-generation job.

    Attributes:
      prompts: the prompts file (`tev_jax.text_io.read_prompts`).
      output: OUT.jsonl; settings in ``OUT.settings.json``.
      target: the target checkpoint directory.
      drafter: the drafter checkpoint directory (None for AR).
      config: how to decode; its stop tokens default to the target's (`stop_token_ids`)
        and its prompt buffer to the longest prompt of the file (rounded up to 8).
      batch_size: row slots of continuous batching.
      truncate: keep the last ``config.prompt_len`` tokens of a longer prompt instead
        of refusing it.
      force: append to OUT even if it was written with other settings.
      seed: sampling seed (each process folds in its index).
      dtype: parameter and KV-cache dtype.
      process_index, process_count: this process's shard of the file.
      sync_rounds: return to the host (progress) at least every this many rounds.
      method: how the summary names the models.
    """

    prompts: str
    output: str
    target: str
    drafter: str | None
    config: DecodeConfig
    batch_size: int = 8
    truncate: bool = False
    force: bool = False
    seed: int = 0
    dtype: str = "float32"
    process_index: int = 0
    process_count: int = 1
    sync_rounds: int = 16
    method: str = ""

    def settings(self, config: DecodeConfig, mesh) -> dict:
        """What decides the results (compared on resumption) and, under 'run', what not."""
        from tev_jax import __version__

        s = config.sampling
        mesh_shape = [1 if mesh is None else int(mesh.shape.get(a, 1)) for a in MESH_AXES]
        return {
            "target": self.target, "drafter": self.drafter, "builder": config.builder,
            "budget": (None if config.builder != "ddtree" else config.budget.as_dict()
                       if isinstance(config.budget, AutoBudget) else config.budget),
            "verifier": config.verifier if config.builder != "none" else None,
            "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
            "max_new_tokens": config.max_new_tokens,
            "stop_token_ids": list(config.stop_token_ids), "seed": self.seed,
            "truncate_to": config.prompt_len if self.truncate else None,
            "dtype": self.dtype,
            outputs.RUN_KEY: {
                "prompts": self.prompts, "batch_size": self.batch_size, "mesh": mesh_shape,
                "prompt_len": config.prompt_len, "process_index": self.process_index,
                "process_count": self.process_count, "tev_jax": __version__},
        }


# tqdm's own rate is per update: several rows finishing in one call read thousands of
# prompts/s. The bar shows rates over a time window instead (`tev_jax.batch.rates`).
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"


def _bar_rates(window: WindowRate, left: int, block_tokens: float, rounds: int) -> dict:
    prompts, tokens = window.rate("prompts"), window.rate("tokens")
    eta = "-" if not prompts else time.strftime("%M:%S" if left / prompts < 3600 else
                                                "%H:%M:%S", time.gmtime(left / prompts))
    return {"ETA": eta, "prompt/s": "-" if prompts is None else f"{prompts:.2f}",
            "tok/s": "-" if tokens is None else f"{tokens:.1f}",
            "tau": f"{block_tokens / rounds:.2f}" if rounds else "-"}


def generate_file(job: FileJob, *, mesh=None, progress: bool = True) -> dict:
    """Runs ``job``; -> its summary (also printed to stderr).

    The output is locked for the whole run (`tev_jax.runtime.locks.lock_output`), and nothing
    is written before every check has passed: the prompts (file and line named), the
    checkpoints, the output's settings, the batch on the mesh and the pre-flight memory
    check from shapes (`tev_jax.costs.plan.check_decode_floor`). A finished output is put in
    input order.

    Raises:
      ValueError: a bad setting, prompts file, prompt, checkpoint, an output written
        with other settings (without ``force``) or by another process right now, or
        an output that cannot be written.
      tev_jax.costs.plan.NotEnoughMemory: the decode state would not fit the device.
      Interrupted: SIGINT (or SIGTERM turned into it by the caller); the results so
        far are on disk and a rerun resumes.
    """
    if job.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {job.batch_size}")
    if job.sync_rounds < 1:
        raise ValueError(f"--sync-rounds must be >= 1, got {job.sync_rounds}")
    if job.truncate and job.config.prompt_len is None:
        raise ValueError("--truncate left needs --prompt-len")
    out = outputs.shard_path(job.output, job.process_index, job.process_count)
    if Path(job.prompts).resolve() in (out.resolve(), Path(job.output).resolve()):
        raise ValueError(f"--prompts and --output are the same file ({job.prompts}): the "
                         "results would overwrite the prompts; write another --output")
    with outputs.lock_output(out):
        try:
            return _run(job, out, mesh, progress)
        except Interrupted:
            raise
        except KeyboardInterrupt as e:  # before decoding started
            raise Interrupted(f"no result was written to {out} yet: run the same command "
                              "again to start it") from e


def _run(job: FileJob, out: Path, mesh, progress: bool) -> dict:
    from tqdm import tqdm

    from tev_jax import engine
    from tev_jax.costs import plan
    from tev_jax.models import load_drafter, load_target, load_tokenizer

    records = text_io.read_prompts(job.prompts)
    tokenizer = load_tokenizer(job.target)
    chat = text_io.chat_formatter(job.target)
    dtype = jnp.dtype(job.dtype)
    target = load_target(job.target, dtype=dtype, mesh=mesh)
    # Every process encodes the whole file, so all agree on the default prompt buffer.
    requests = text_io.encode_records(
        records, tokenizer, chat, vocab_size=target.config.vocab_size,
        prompt_len=job.config.prompt_len, truncate=job.truncate, where=str(job.prompts),
        max_positions=target.config.max_position_embeddings,
        max_new_tokens=job.config.max_new_tokens)
    config = job.config
    if config.prompt_len is None:
        config = dataclasses.replace(
            config, prompt_len=-(-max(len(r.prompt_ids) for r in requests) // 8) * 8)
    if not config.stop_token_ids:
        config = dataclasses.replace(config, stop_token_ids=stop_token_ids(target, tokenizer))
    settings = job.settings(config, mesh)
    mine = outputs.shard_of(list(enumerate(requests)), job.process_index,
                             job.process_count)
    outputs.check_output_settings(out, settings, force=job.force,
                                   ids={text_io.id_key(r.id) for _, r in mine})
    drafter = (None if job.drafter is None
               else load_drafter(job.drafter, target, dtype=dtype, mesh=mesh))
    # An automatic budget is checked as the widest program it runs (all slot counts
    # share its cache length).
    if isinstance(config.budget, AutoBudget) and config.builder == "ddtree":
        check_tuned_for(config.budget, target, drafter)
    # more slots than prompts would only cost memory: decode with as many as there are
    batch = slots.fit_batch(job.batch_size, len(mine), mesh)
    widest = slots.slot_configs(config, batch, mesh=mesh)[batch]
    engine.decode_spec(target, drafter, widest, batch, mesh=mesh)
    plan.check_decode_floor(target, drafter, widest, batch, mesh=mesh)
    done, f = outputs.open_output(out, settings, force=job.force, expected=len(mine))
    todo = [(i, r) for i, r in mine if text_io.id_key(r.id) not in done]
    index = {text_io.id_key(r.id): i for i, r in todo}
    fingerprint = outputs.settings_fingerprint(settings)
    # prompt i of the file decodes with row key i: a sampled output does not depend on
    # the process count, the batch or a resume
    key = jax.random.key(job.seed)
    tokens = rounds = block_tokens = written = 0
    reasons = {"stop": 0, "length": 0}
    bar = None
    if progress and todo:
        print(f"compiling and prefilling the first {min(batch, len(todo))} "
              "prompt(s) ...", file=sys.stderr)
    t0 = time.perf_counter()
    try:
        with f:
            for r in continuous.generate_continuous(target, drafter,
                                                  [dataclasses.replace(r, row=i)
                                                   for i, r in todo],
                                                  config, batch_size=batch,
                                                  key=key, max_rounds=job.sync_rounds,
                                                  mesh=mesh):
                outputs.write_line(f, {
                    "id": r.id, "index": index[text_io.id_key(r.id)],
                    "text": tokenizer.decode(r.token_ids), "token_ids": r.token_ids,
                    "rounds": r.rounds, "tau": None if r.rounds == 0 else round(r.tau, 4),
                    "stop_reason": r.stop_reason, "prompt_tokens": r.prompt_tokens,
                    "settings": fingerprint})
                written += 1
                tokens += len(r.token_ids)
                reasons[r.stop_reason] += 1
                if r.rounds:
                    rounds += r.rounds
                    block_tokens += r.tau * r.rounds
                if bar is None:  # the rates and ETA leave out compiling the first batch
                    bar = tqdm(total=len(todo), initial=written, unit="prompt",
                               file=sys.stderr, disable=not progress, bar_format=BAR_FORMAT)
                    window = WindowRate()
                else:
                    bar.update(1)
                    window.add(prompts=1, tokens=len(r.token_ids))
                bar.set_postfix(_bar_rates(window, len(todo) - written, block_tokens, rounds),
                                refresh=False)
    except KeyboardInterrupt as e:
        raise Interrupted(f"{len(done) + written} of the {len(mine)} results are in {out}; "
                          "run the same command again to resume") from e
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - t0
    if len(done) + written == len(mine):
        outputs.sort_output(out)
    summary = {"output": str(out), "prompts": len(todo), "skipped": len(done),
               "new_tokens": tokens, "seconds": round(seconds, 3),
               "prompts_per_s": round(len(todo) / seconds, 3),
               "tokens_per_s": round(tokens / seconds, 2),
               "tau": round(block_tokens / rounds, 4) if rounds else None,
               "stop_reasons": reasons, "batch_size": batch,
               "method": job.method}
    tau = (f"tau = {summary['tau']}" if rounds else
           "tau n/a (nothing was left to decode)" if not todo else
           "tau n/a (every prompt ended at its first token: no decode round ran)")
    print(f"[{job.method}] {len(todo)} prompts ({len(done)} already in {out}), {tokens} new "
          f"tokens in {seconds:.1f} s (compilation included): {summary['tokens_per_s']} "
          f"tokens/s, {summary['prompts_per_s']} prompts/s, {tau}", file=sys.stderr)
    return summary


__all__ = ["FileJob", "Interrupted", "generate_file"]
