"""Batch generation: ``tev-jax generate --prompts FILE --output OUT.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path


from tev_jax.cli import flags


def add_batch_options(p) -> None:
    g = p.add_argument_group(
        "batch generation", "--prompts FILE --output OUT.jsonl decodes every prompt of FILE "
        "with continuous batching (JSONL with id + prompt / messages / prompt_ids, or "
        "plain text, one prompt per line); a rerun resumes OUT")
    g.add_argument("--prompts", default=None, metavar="FILE",
                   help="the prompts file, or bundled:NAME for a bundled evaluation set "
                        "(mt_bench, humaneval, gsm, math)")
    g.add_argument("--output", default=None, metavar="OUT.jsonl",
                   help="results, one JSON line per prompt; settings in OUT.settings.json")
    g.add_argument("--batch-size", type=int, default=8, help="row slots (default %(default)s)")
    g.add_argument("--prompt-len", type=int, default=None,
                   help="prompt buffer in tokens (default: the longest prompt of FILE)")
    g.add_argument("--truncate", choices=("none", "left"), default="none",
                   help="left: keep the last --prompt-len tokens of a longer prompt "
                        "(default: refuse it)")
    g.add_argument("--force", action="store_true",
                   help="append to OUT even if it was written with other settings")
    g.add_argument("--summary-json", default=None, metavar="PATH",
                   help="also write the end-of-run summary as JSON")
    g.add_argument("--process-index", type=int, default=None,
                   help="this process's shard (default: jax.process_index())")
    g.add_argument("--process-count", type=int, default=None,
                   help="number of shards (default: jax.process_count()); process i takes "
                        "prompts i, i + count, ... and writes OUT.<i>-of-<count>.jsonl")
    g.add_argument("--sync-rounds", type=int, default=16,
                   help="return to the host (progress bar) at least every this many rounds")


SINGLE_PROMPT_HINTS = {
    "--chat": "with --prompts FILE, chat prompts are JSONL records with 'messages'",
    "--compare-ar": "for AR's speed on the same prompts, run the file again with --builder "
                    "none",
}
"""What to do instead, for the single-PROMPT flags a --prompts FILE refuses."""


def _process_shard(args) -> tuple[int, int]:
    import jax

    if args.process_index is None and args.process_count is None:
        return jax.process_index(), jax.process_count()
    if args.process_index is None or args.process_count is None:
        raise ValueError("give both --process-index and --process-count")
    if args.process_count < 1 or not 0 <= args.process_index < args.process_count:
        raise ValueError(f"--process-index {args.process_index} is outside "
                         f"[0, --process-count {args.process_count})")
    return args.process_index, args.process_count


def batch_generate_command(args) -> int:
    """``tev-jax generate --prompts FILE --output OUT.jsonl``: continuous batching
    (`tev_jax.batch.job.generate_file`)."""
    from tev_jax.batch import job

    if args.prompt is not None:
        raise ValueError("give either a PROMPT or --prompts FILE, not both")
    if args.output is None:
        raise ValueError("--prompts needs --output OUT.jsonl")
    single = [flag for flag, given in (
        ("--chat", args.chat), ("--compare-ar", args.compare_ar),
        ("--repeats", args.repeats != 1), ("--no-stream", args.no_stream)) if given]
    if single:
        hints = [SINGLE_PROMPT_HINTS[f] for f in single if f in SINGLE_PROMPT_HINTS]
        raise ValueError(f"{', '.join(single)} only appl{'ies' if len(single) == 1 else 'y'} "
                         "to a single PROMPT" + "".join(f"; {h}" for h in hints))
    flags.check_inputs(args)
    flags.check_writable(args.summary_json, "--summary-json")
    index, count = _process_shard(args)
    target_dir, drafter_dir, where = flags.checkpoint_dirs(args)
    file_job = job.FileJob(
        prompts=args.prompts, output=args.output, target=target_dir, drafter=drafter_dir,
        config=flags.decode_config(args, prompt_len=args.prompt_len),
        batch_size=args.batch_size, truncate=args.truncate == "left", force=args.force,
        seed=args.seed, dtype=args.dtype, process_index=index, process_count=count,
        sync_rounds=args.sync_rounds, method=where)
    summary = job.generate_file(file_job, mesh=flags.mesh_from(args))
    if args.summary_json:
        try:
            Path(args.summary_json).write_text(json.dumps(summary, indent=1) + "\n")
        except OSError as e:
            raise ValueError(f"--summary-json {args.summary_json}: cannot write it "
                             f"({e.strerror or e}); the results are in {summary['output']}"
                             ) from None
    return 0
