"""The ``tev-jax`` command line: one small function per subcommand.

Each subcommand parses its arguments into library objects and calls the library; the
work lives in ``tev_jax``. Add a subcommand by writing ``_add_<name>(subparsers)`` that
registers its arguments and sets ``func``, and listing it in ``SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time

import jax
import numpy as np

from tev_jax.exit_law import exit_law
from tev_jax.sampling import Sampling, check_finite
from tev_jax.tree import make_tree, render
from tev_jax.verify import tev

# The demo tree: the last committed word is "the"; the drafter proposed these
# continuations (slot order = a best-first builder's order).
_DEMO_WORDS = ["the", "cat", "dog", "sat", "ran", "on", "mat", "away", "a", "end"]
_DEMO_TOKENS = [0, 1, 2, 3, 4, 3, 5, 7, 0]
_DEMO_PARENTS = [-1, 0, 0, 1, 1, 2, 3, 4, 6]
#   the ─┬─ cat ─┬─ sat ── on ── the
#        │       └─ ran ── away
#        └─ dog ── sat


def _demo_logits(seed: int) -> np.ndarray:
    """Target logits that put most (not all) mass on the drafted continuations."""
    rng = np.random.default_rng(seed)
    n, vocab = len(_DEMO_TOKENS), len(_DEMO_WORDS)
    logits = rng.normal(0.0, 0.5, (n, vocab)).astype(np.float32)
    for i in range(1, n):
        logits[_DEMO_PARENTS[i], _DEMO_TOKENS[i]] += 2.5
    return logits


def _sampling_from(args) -> Sampling:
    return Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


def exit_law_demo(args) -> int:
    """``tev-jax exit-law --demo``: an example tree, its exit law and some TEV draws."""
    sampling = _sampling_from(args)
    tree = make_tree(_DEMO_TOKENS, _DEMO_PARENTS)
    horizon = int(np.asarray(tree.depths).max())
    logits = _demo_logits(args.seed)
    check_finite(logits)
    law = jax.jit(exit_law, static_argnames="sampling")(tree, logits, sampling)
    word = _DEMO_WORDS.__getitem__
    print(f"Draft tree over a {len(_DEMO_WORDS)}-word vocabulary, target {sampling}:")
    print("  P = reach, rho = local exit, w = exit weight = P * rho\n")
    print(render(tree, decode=word, annotations={"P": law.reach, "rho": law.rho, "w": law.w}))
    print(f"\nsum w = {float(law.w.sum()):.6f}   coverage C = {float(law.coverage):.4f}   "
          f"expected block length 1 + C = {float(law.expected_length):.4f}")

    draw = jax.jit(jax.vmap(functools.partial(tev, sampling=sampling, horizon=horizon),
                            in_axes=(0, None, None)))
    keys = jax.random.split(jax.random.key(args.seed), max(args.draws, 1))
    verdicts = jax.device_get(draw(keys, tree, logits))
    tokens = np.asarray(tree.tokens)
    print(f"\nTEV draws (exit ~ w, bonus from the exit's residual), seed {args.seed}:")
    for b in range(min(args.show, args.draws)):
        path = [int(s) for s in verdicts.path[b] if s >= 0]
        block = [word(int(tokens[s])) for s in path[1:]] + [f"[{word(int(verdicts.bonus[b]))}]"]
        print(f"  exit slot {int(verdicts.exit_node[b])}: {' '.join(block)}")
    print(f"\nmean block length over {args.draws} draws = {verdicts.length.mean():.4f} "
          f"(exact: {float(law.expected_length):.4f})")
    return 0


def _add_exit_law(sub) -> None:
    p = sub.add_parser("exit-law", help="show the canonical exit law of a draft tree")
    p.add_argument("--demo", action="store_true", required=True,
                   help="use the built-in example tree and synthetic target logits")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--draws", type=int, default=10_000, help="TEV draws for the mean length")
    p.add_argument("--show", type=int, default=5, help="how many draws to print")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=exit_law_demo)


BUNDLED_PREFIX = "bundled:"


def _checkpoint_dirs(args) -> tuple[str, str | None, str]:
    """(target dir, drafter dir or None, description) from the flags and the bundle.

    ``--drafter bundled:NAME`` picks one of the bundled drafters (with the bundled
    target); no ``--drafter`` means the bundled default (ExitTrain).
    """
    from tev_jax.models.bundled import DEFAULT_DRAFTER, bundled_paths, check_drafter_name

    needs_drafter = args.builder != "none"
    name = None
    if args.drafter is None or args.drafter.startswith(BUNDLED_PREFIX):
        name = DEFAULT_DRAFTER if args.drafter is None else args.drafter[len(BUNDLED_PREFIX):]
        check_drafter_name(name)
    if args.target is None:
        paths = bundled_paths()
        drafter = paths.drafters[name] if name is not None else args.drafter
        where = "bundled target" + (
            "" if not needs_drafter else
            f" + bundled {name} drafter" if name is not None else f" + drafter {args.drafter}")
        return str(paths.target), str(drafter) if needs_drafter else None, where
    if needs_drafter and name is not None:
        raise ValueError(f"--drafter is required with --target and --builder {args.builder}: "
                         "the bundled drafters only fit the bundled target (or use "
                         "--builder none for plain autoregressive decoding)")
    where = f"target {args.target}" + (f" + drafter {args.drafter}" if needs_drafter else "")
    return args.target, args.drafter if needs_drafter else None, where


def _stop_ids(target, tokenizer) -> tuple[int, ...]:
    """config.json's eos ids, else the project tokenizer's <|end|> / <|eos|> if present."""
    from tev_jax.data.tokenizer import END, EOS

    if target.config.eos_token_ids:
        return tuple(target.config.eos_token_ids)
    ids = (tokenizer.token_to_id(t) for t in (END, EOS))
    return tuple(i for i in ids if i is not None)


def _timed(target, drafter, prompt, config, seed, repeats):
    """(Generation with the median seconds of ``repeats`` runs, compile seconds)."""
    from tev_jax import decode

    t0 = time.perf_counter()
    run = decode.compiled_generate(target, drafter, [prompt], config, seed)
    compile_s = time.perf_counter() - t0
    gens = [run() for _ in range(max(repeats, 1))]
    seconds = float(np.median([g.stats.seconds for g in gens]))
    stats = dataclasses.replace(gens[-1].stats, seconds=seconds)
    return dataclasses.replace(gens[-1], stats=stats), compile_s


def generate_command(args) -> int:
    """``tev-jax generate PROMPT``: decode one prompt and print a summary.

    The completion goes to stdout; the summary (models, method, tokens, τ, tokens/s,
    compile time, and with ``--compare-ar`` the AR speed and the speed-up) to stderr.
    """
    from tev_jax import decode
    from tev_jax.data.tokenizer import format_chat
    from tev_jax.models import load_drafter, load_target, load_tokenizer

    sampling = _sampling_from(args)
    config = decode.DecodeConfig(
        max_new_tokens=args.max_new_tokens, builder=args.builder, budget=args.budget,
        verifier=args.verifier, sampling=sampling)
    target_dir, drafter_dir, where = _checkpoint_dirs(args)
    target = load_target(target_dir)
    tokenizer = load_tokenizer(target_dir)
    drafter = None if drafter_dir is None else load_drafter(drafter_dir, target)
    config = dataclasses.replace(config, stop_token_ids=_stop_ids(target, tokenizer))
    text = format_chat(args.prompt) if args.chat else args.prompt
    prompt = tokenizer.encode(text).ids
    gen, compile_s = _timed(target, drafter, prompt, config, args.seed, args.repeats)
    n = int(gen.lengths[0])
    print(tokenizer.decode(prompt + gen.tokens[0, :n].tolist()), flush=True)

    speed = n / gen.stats.seconds
    method = ("autoregressive" if args.builder == "none" else
              f"{args.builder}" + (f" (budget {args.budget})" if args.builder == "ddtree" else "")
              + f" + {args.verifier}")
    lines = [f"[{where}; {method}; T={sampling.temperature:g}]",
             f"{n} new tokens in {gen.stats.rounds} rounds: tau = {gen.stats.tau:.2f} "
             f"tokens/round, {speed:.1f} tokens/s "
             f"({gen.stats.seconds:.3f} s; compile {compile_s:.1f} s, not counted)"]
    if args.compare_ar:
        if args.builder == "none":
            lines.append("--compare-ar: this run is already autoregressive")
        else:
            ar, _ = _timed(target, None, prompt, dataclasses.replace(config, builder="none"),
                           args.seed, args.repeats)
            ar_speed = int(ar.lengths[0]) / ar.stats.seconds
            lines.append(f"AR {ar_speed:.1f} tokens/s -> speed-up {speed / ar_speed:.2f}x "
                         "(same target, same run)")
    print("\n".join(lines), file=sys.stderr)
    return 0


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="speculative decoding of one prompt",
                       description="Decodes PROMPT with the bundled demo models (or "
                                   "--target/--drafter) and prints the text and a summary.")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--target", default=None,
                   help="target checkpoint directory (config.json, safetensors, "
                        "tokenizer.json); default: the bundled demo target")
    p.add_argument("--drafter", default=None,
                   help="DFlash drafter checkpoint directory, or bundled:exittrain / "
                        "bundled:dflash; default: the bundled ExitTrain drafter when "
                        "--target is not given")
    p.add_argument("--builder", choices=("ddtree", "chain", "none"), default="ddtree",
                   help="ddtree (default), chain (plain DFlash) or none (autoregressive)")
    p.add_argument("--budget", type=int, default=64, help="DDTree node budget (default %(default)s)")
    p.add_argument("--verifier", choices=("tev", "predraw", "sequential", "greedy"),
                   default="tev", help="exact tree verifier (default %(default)s; greedy: T = 0 only)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None, help="sampling: keep the k best")
    p.add_argument("--top-p", type=float, default=None, help="sampling: nucleus mass")
    p.add_argument("--max-new-tokens", type=int, default=256,
                   help="at most this many (default %(default)s); stops at <|end|> / <|eos|>")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the chat template (one user turn)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default %(default)s)")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs after the compile run (the median is reported)")
    p.add_argument("--compare-ar", action="store_true",
                   help="also time plain autoregressive decoding and report the speed-up")
    p.set_defaults(func=generate_command)


# (label, bundled drafter, builder, verifier) of `tev-jax compare`, AR first.
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
    prompts share a fixed prompt buffer) and ``--repeats`` timed times (the median
    counts). τ = output tokens per round over all prompts; tokens/s = new tokens over
    the summed seconds.
    """
    from tev_jax import decode
    from tev_jax.data.tokenizer import format_chat
    from tev_jax.models import load_drafter, load_target, load_tokenizer
    from tev_jax.models.bundled import bundled_paths

    sampling = _sampling_from(args)
    paths = bundled_paths()
    target = load_target(paths.target)
    tokenizer = load_tokenizer(paths.target)
    texts = args.prompts or COMPARE_PROMPTS
    prompts = [tokenizer.encode(format_chat(t) if args.chat else t).ids for t in texts]
    base = decode.DecodeConfig(max_new_tokens=args.max_new_tokens, budget=args.budget,
                               sampling=sampling, stop_token_ids=_stop_ids(target, tokenizer),
                               prompt_len=max(len(p) for p in prompts))
    rows, outputs = [], []
    for label, name, builder, verifier in COMPARE_METHODS:
        drafter = None if name is None else load_drafter(paths.drafters[name], target)
        config = dataclasses.replace(base, builder=builder, verifier=verifier)
        tokens = blocks = rounds = 0
        seconds, texts_out = 0.0, []
        for prompt in prompts:
            gen, _ = _timed(target, drafter, prompt, config, args.seed, args.repeats)
            n = int(gen.lengths[0])
            tokens, seconds = tokens + n, seconds + gen.stats.seconds
            blocks += int(gen.stats.block_lengths.sum())
            rounds += int(gen.stats.rounds_per_row.sum())
            texts_out.append(gen.tokens[0, :n].tolist())
        rows.append((label, blocks / rounds, tokens / seconds, tokens))
        outputs.append(texts_out)
    ar_speed = rows[0][2]
    print(f"bundled target, {len(prompts)} prompt(s), T={sampling.temperature:g}, "
          f"DDTree budget {args.budget}, at most {args.max_new_tokens} new tokens each")
    print(f"{'method':28s} {'tau':>6s} {'tokens/s':>9s} {'vs AR':>6s} {'tokens':>7s}")
    for label, tau, speed, n in rows:
        print(f"{label:28s} {tau:6.2f} {speed:9.1f} {speed / ar_speed:5.2f}x {n:7d}")
    if sampling.greedy:
        same = all(o == outputs[0] for o in outputs[1:])
        print("greedy outputs identical across methods: " + ("yes" if same else
              "NO (exact verifiers must reproduce the target's greedy text)"))
    return 0


def _add_compare(sub) -> None:
    p = sub.add_parser("compare", help="AR vs DFlash + DDTree vs ExitTrain + TEV (bundled)",
                       description="Decodes the same prompts with the bundled target alone, "
                                   "with the DFlash drafter + DDTree + predraw and with the "
                                   "ExitTrain drafter + DDTree + TEV; prints tau and tokens/s.")
    p.add_argument("prompts", nargs="*", help="prompt texts (default: three examples)")
    p.add_argument("--budget", type=int, default=64,
                   help="DDTree node budget (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs per prompt after the compile run (the median counts)")
    p.set_defaults(func=compare_command)


def train_command(args) -> int:
    """``tev-jax train ...``: the drafter-training CLI of the repository's ``train/``."""
    try:
        from train.__main__ import main as train_main
    except ImportError as e:
        raise ValueError("`tev-jax train` runs the repository's train/ folder: call it from "
                         f"the repository root, or use `python -m train` there ({e})") from e
    return train_main(args.train_args)


def _add_train(sub) -> None:
    p = sub.add_parser("train", add_help=False,
                       help="drafter training: same as `python -m train` (repository root)")
    p.add_argument("train_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=train_command)


SUBCOMMANDS = [_add_exit_law, _add_generate, _add_compare, _add_train]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tev-jax", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        parser.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
