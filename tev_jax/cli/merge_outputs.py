"""``tev-jax merge-outputs OUT.jsonl``: join the per-process shards of OUT."""

from __future__ import annotations

import sys


def merge_outputs_command(args) -> int:
    """``tev-jax merge-outputs OUT.jsonl``: join the per-process shards of OUT."""
    from tev_jax.batch import outputs

    n = outputs.merge_outputs(args.output, force=args.force)
    print(f"{n} results -> {args.output}", file=sys.stderr)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("merge-outputs", help="join the shards OUT.<i>-of-<n>.jsonl into OUT",
                       description="Joins the per-process outputs of `tev-jax generate "
                                   "--prompts ... --process-count n` into OUT.jsonl.")
    p.add_argument("output", help="OUT.jsonl, as given to generate --output")
    p.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    p.set_defaults(func=merge_outputs_command)
