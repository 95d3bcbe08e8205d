"""``tev-jax tune``: the best tree budget per batch size, from the exit law."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys


from tev_jax.cli import flags


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"need comma-separated ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need positive ints, got {text!r}")
    return values


def tune_command(args) -> int:
    """``tev-jax tune --prompts FILE``: τ(b) from the exit law, round costs and the best
    budget per batch size (`tev_jax.costs.tune.tune`); ``--json FILE`` is the tuning file of
    ``--budget auto --tuning FILE``."""
    import jax.numpy as jnp

    from tev_jax import text_io
    from tev_jax.costs import round_costs, tune
    from tev_jax.models import load_drafter, load_target, load_tokenizer
    from tev_jax.text_io import stop_token_ids

    flags.at_least_one(args, "--repeats", "--max-new-tokens")
    flags.check_inputs(args)
    flags.check_writable(args.json, "--json")
    flags.check_writable(args.figure, "--figure")
    if args.figure and importlib.util.find_spec("matplotlib") is None:
        raise ValueError(f"--figure {args.figure} needs matplotlib (pip install -e "
                         "\".[plots]\"); nothing was tuned")
    target_dir, drafter_dir, where = flags.checkpoint_dirs(args)
    dtype = jnp.dtype(args.dtype)
    target = load_target(target_dir, dtype=dtype)
    tokenizer = load_tokenizer(target_dir)
    drafter = load_drafter(drafter_dir, target, dtype=dtype)
    chat = text_io.chat_formatter(target_dir)
    requests = text_io.encode_records(
        text_io.read_prompts(args.prompts), tokenizer, chat,
        vocab_size=target.config.vocab_size, prompt_len=args.prompt_len,
        truncate=args.truncate == "left", where=args.prompts)
    config = flags.decode_config(args, prompt_len=args.prompt_len,
                                 stop_token_ids=stop_token_ids(target, tokenizer))
    mesh_axes = (args.mesh_data, args.mesh_fsdp, args.mesh_tensor)
    if args.topology and args.gpu:
        raise ValueError("give one of --topology (a TPU slice) or --gpu (GPUs), not both")
    costs = (f"the {args.topology} roofline" if args.topology else
             f"the {round_costs.cost_basis(args.gpu)} of {args.gpu}" if args.gpu else
             f"{args.repeats} timed rounds per budget and batch size")
    print(f"tuning {len(requests)} prompt(s): one decode round at budget "
          f"{max(args.budgets)} per position, then {costs} ...", file=sys.stderr, flush=True)
    with _Bars() as bars:
        result = tune.tune(target, drafter, [r.prompt_ids for r in requests], config,
                           budgets=args.budgets, batch_sizes=args.batch,
                           repeats=args.repeats, key=args.seed, topology=args.topology,
                           gpu=args.gpu,
                           mesh_axes=None if mesh_axes == (1, 1, 1) else mesh_axes,
                           dtype=jnp.bfloat16 if args.topology or args.gpu else None,
                           progress=bars)
    result = dataclasses.replace(result, settings=result.settings | {
        "prompts_file": args.prompts, "models": where})
    if args.json:
        result.write(args.json)
    if args.figure:
        tune.plot(result, args.figure)
    print(f"[{where}; {len(requests)} prompts, {result.settings['contexts']} contexts; "
          f"T={config.sampling.temperature:g}; costs: {result.settings['device']}]")
    print(result.format())
    return 0


_TUNE_ABOUT = (
    "Continues each prompt with the target's own text, runs one decode round at the "
    "largest budget at every position, and reads τ(b) for every smaller budget from the "
    "exit law (DDTree trees are nested); times one round per budget and batch size (or "
    "takes the TPU roofline with --topology, the GPU's calibrated estimate with --gpu); "
    "prints, per batch size, the budget with the most tokens/s, or AR where nothing "
    "beats it. --json FILE feeds `generate --budget auto "
    "--tuning FILE`.")


class _Bars:
    """One tqdm bar per step of the tuner (target continuations of the prompts, the
    contexts' rounds, the budget programs, the timed passes), on stderr."""

    LABELS = {"prompts": "continuing prompts", "contexts": "rounds at contexts",
              "programs": "compiling budgets", "timed passes": "timing budgets"}

    def __init__(self):
        self.bar, self.what = None, None

    def __call__(self, what: str, done: int, total: int) -> None:
        from tqdm import tqdm

        if what != self.what:
            self.close()
            self.bar = tqdm(total=total, desc=self.LABELS.get(what, what), file=sys.stderr)
            self.what = what
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def add_parser(sub) -> None:
    p = sub.add_parser("tune", description=_TUNE_ABOUT,
                       help="the best tree budget per batch size, from the exit law")
    p.add_argument("--prompts", required=True, metavar="FILE",
                   help="prompts file (as generate --prompts: JSONL or plain text)")
    p.add_argument("--target", default=None, help="target checkpoint (default: bundled)")
    p.add_argument("--drafter", default=None,
                   help="drafter checkpoint, or bundled:exittrain / bundled:dflash")
    p.add_argument("--budgets", type=_ints, default=(16, 32, 64, 128),
                   help="comma-separated DDTree budgets (default 16,32,64,128)")
    p.add_argument("--batch", type=_ints, default=(1, 8),
                   help="comma-separated batch sizes (default 1,8)")
    flags.add_decode_flags(p, max_new_tokens=64, tree=False)
    p.add_argument("--prompt-len", type=int, default=None,
                   help="prompt buffer (default: the longest prompt)")
    p.add_argument("--truncate", choices=("none", "left"), default="none",
                   help="left: keep the last --prompt-len tokens of a longer prompt")
    p.add_argument("--repeats", type=int, default=10, help="timed passes (median)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="parameter and cache dtype (default float32)")
    p.add_argument("--topology", default=None, metavar="NAME",
                   help="costs from the TPU compiler's roofline for this slice (e.g. "
                        "v5e:2x4; tpu extra) instead of timing the local devices")
    p.add_argument("--gpu", default=None, metavar="NAME",
                   help="costs from the GPU compiler for these GPUs (e.g. h200x1; gpu "
                        "extra): the calibrated estimate where the GPU was measured "
                        "(tev_jax/data/gpus), else the roofline")
    flags.add_mesh_flags(p)
    p.add_argument("--json", default=None, metavar="FILE", help="write the tuning file")
    p.add_argument("--figure", default=None, metavar="PNG",
                   help="τ(b) and tokens/s(b) per batch size (plots extra)")
    p.set_defaults(func=tune_command, builder="ddtree")
