"""``tev-jax compare``: AR, DFlash + DDTree + predraw and ExitTrain + DDTree + TEV side by side."""

from __future__ import annotations

import dataclasses
import sys

from tev_jax.cli import flags

COMPARE_METHODS = (
    ("AR (target alone)", None, "none", "tev"),
    ("DFlash + DDTree + predraw", "dflash", "ddtree", "predraw"),
    ("ExitTrain + DDTree + TEV", "exittrain", "ddtree", "tev"),
)
COMPARE_PROMPTS = ("def fibonacci(n):",
                   "Question: Tom has 3 boxes of 12 apples. He eats 5. How many are left?\n"
                   "Answer:",
                   "The history of the printing press")


def compare_command(args) -> int:
    """``tev-jax compare [PROMPT ...]``: AR, DFlash + DDTree + predraw and ExitTrain +
    DDTree + TEV on the same prompts with the bundled models; τ and tokens/s side by side.

    Each method runs every prompt once to compile (one compilation per method: the
    prompts share a fixed prompt buffer); then ``--repeats`` timed passes run every
    method in turn (the median pass counts, and the range of the per-pass ratios to AR
    is printed beside the median's); `tev_jax.costs.timing.compare_methods` does the timing.
    """
    from tev_jax.decode import DecodeConfig

    from tev_jax.costs import timing
    from tev_jax.data.tokenizer import format_chat
    from tev_jax.models import load_drafter, load_target, load_tokenizer
    from tev_jax.models.bundled import bundled_paths
    from tev_jax.prompts import check_context
    from tev_jax.text_io import stop_token_ids

    flags.at_least_one(args, "--repeats", "--budget", "--max-new-tokens")
    if any(not t for t in args.prompts):
        raise ValueError("an empty PROMPT: give some text to continue")
    for i, t in enumerate(args.prompts):
        flags.check_text(t, f"PROMPT {i + 1}")
    sampling = flags.sampling_from(args)
    paths = bundled_paths()
    target = load_target(paths.target)
    tokenizer = load_tokenizer(paths.target)
    texts = args.prompts or COMPARE_PROMPTS
    prompts = [tokenizer.encode(format_chat(t) if args.chat else t).ids for t in texts]
    for i, p in enumerate(prompts):
        check_context(len(p), args.max_new_tokens, target.config.max_position_embeddings,
                      what=f"PROMPT {i + 1}")
    base = DecodeConfig(max_new_tokens=args.max_new_tokens, budget=args.budget,
                        sampling=sampling, stop_token_ids=stop_token_ids(target, tokenizer),
                        prompt_len=max(len(p) for p in prompts))
    methods = [(label, None if name is None else load_drafter(paths.drafters[name], target),
                dataclasses.replace(base, builder=builder, verifier=verifier))
               for label, name, builder, verifier in COMPARE_METHODS]

    def started(i, label):
        print(f"[{i + 1}/{len(methods)}] {label}: compiling {len(prompts)} prompt(s)"
              + (f", then timing {args.repeats} passes of every method ..."
                 if i == len(methods) - 1 else " ..."), file=sys.stderr, flush=True)

    rows = timing.compare_methods(target, methods, prompts, key=args.seed,
                                   repeats=args.repeats, on_method=started)
    ar_speed, ar = rows[0].tokens_per_second, rows[0]
    print(f"bundled target, {len(prompts)} prompt(s), T={sampling.temperature:g}, "
          f"DDTree budget {args.budget}, at most {args.max_new_tokens} new tokens each; "
          f"median of {args.repeats} timed passes (range: the passes' own ratios)")
    print(f"{'method':28s} {'tau':>6s} {'tokens/s':>9s} {'vs AR':>6s} {'range':>11s} "
          f"{'tokens':>7s}")
    for r in rows:
        ratios = [(r.tokens / s) / (ar.tokens / a) for s, a in zip(r.seconds, ar.seconds)]
        print(f"{r.label:28s} {r.tau:6.2f} {r.tokens_per_second:9.1f} "
              f"{r.tokens_per_second / ar_speed:5.2f}x {min(ratios):5.2f}-{max(ratios):<5.2f} "
              f"{r.tokens:7d}")
    if sampling.greedy:
        same = all(r.outputs == rows[0].outputs for r in rows[1:])
        print("greedy outputs identical across methods: " + ("yes" if same else
              "NO (exact verifiers must reproduce the target's greedy text)"))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("compare", help="AR vs DFlash + DDTree vs ExitTrain + TEV (bundled)",
                       description="Decodes the same prompts with the bundled target alone, "
                                   "with the DFlash drafter + DDTree + predraw and with the "
                                   "ExitTrain drafter + DDTree + TEV; prints tau and tokens/s.")
    p.add_argument("prompts", nargs="*", help="prompt texts (default: three examples)")
    p.add_argument("--budget", type=int, default=64,
                   help="DDTree node budget (default %(default)s)")
    flags.add_sampling_flags(p, temperature=0.0)
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="at most this many per prompt (default %(default)s)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default %(default)s)")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed passes over every method and prompt after the compile run "
                        "(the median counts, the range of the passes is shown; default "
                        "%(default)s)")
    p.set_defaults(func=compare_command)
