"""The flags several ``tev-jax`` subcommands share, and the objects they are read into.

The decoding flags are declared once (`add_decode_flags`, choices from the builder and
verifier registries of `tev_jax.extensions`) and read once (`decode_config`); the
checkpoint flags (`checkpoint_dirs`), the sampling flags and the mesh flags likewise.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from tev_jax.runtime.exit_codes import check_readable

if TYPE_CHECKING:
    from tev_jax.decode import DecodeConfig
    from tev_jax.sampling import Sampling

# The registries' names (`tev_jax.extensions.VERIFIERS`, ``BUILDERS``; a test keeps them
# equal), here so that the command lines parse without importing jax.
VERIFIER_NAMES = ("tev", "predraw", "sequential", "greedy")
BUILDER_NAMES = ("ddtree", "chain", "none")


def add_sampling_flags(p, *, temperature: float) -> None:
    p.add_argument("--temperature", type=float, default=temperature,
                   help="0 = greedy (default %(default)s)")
    p.add_argument("--top-k", type=int, default=None, help="sampling: keep the k best")
    p.add_argument("--top-p", type=float, default=None, help="sampling: nucleus mass")


def sampling_from(args) -> Sampling:
    from tev_jax.sampling import Sampling

    if args.temperature == 0:
        given = [f for f, v in (("--top-k", args.top_k), ("--top-p", args.top_p)) if v is not None]
        if given:
            raise ValueError(f"{' and '.join(given)} has no effect at --temperature 0 "
                             "(greedy decoding); drop it or set a temperature > 0")
    return Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


def at_least_one(args, *flags: str) -> None:
    """Refuses a count flag below 1 (one line naming the flag)."""
    for flag in flags:
        v = getattr(args, flag.lstrip("-").replace("-", "_"))
        if v < 1:
            raise ValueError(f"{flag} must be >= 1, got {v}")


def check_text(text: str, what: str = "the PROMPT") -> str:
    """``text`` if it is valid Unicode; a ValueError naming the first undecodable byte of
    a command-line argument otherwise (Python keeps those as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        byte = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else repr(bad)
        raise ValueError(f"{what} is not valid UTF-8 text ({byte} at character {e.start})"
                         ) from None
    return text


def check_writable(path: str | None, flag: str) -> None:
    """Before any work: a ValueError naming ``flag`` unless ``path`` can be written
    (its folder exists and is writable, and it is not a folder or a read-only file).
    Nothing is created."""
    from pathlib import Path

    if path is None or path == "-":
        return
    p = Path(path)
    folder = p.parent if str(p.parent) else Path(".")
    why = ("is a folder" if p.is_dir() else
           f"its folder {folder} does not exist" if not folder.is_dir() else
           "is not writable" if p.exists() and not os.access(p, os.W_OK) else
           f"its folder {folder} is not writable" if not p.exists()
           and not os.access(folder, os.W_OK | os.X_OK) else None)
    if why:
        raise ValueError(f"{flag} {path}: cannot write it ({why})")


BUNDLED_PREFIX = "bundled:"


def check_inputs(args) -> None:
    """`check_readable` for the input paths the command has among ``--prompts``,
    ``--target``, ``--drafter`` (unless ``--builder none``) and ``--tuning`` (with
    ``--budget auto``), before anything is loaded; ``bundled`` / ``bundled:NAME`` values
    pass (the bundle checks their names)."""
    from tev_jax.models.bundled import BUNDLED

    def given(name):
        value = getattr(args, name, None)
        return None if value is None or value == BUNDLED or str(value).startswith(
            BUNDLED_PREFIX) else value

    check_readable(given("prompts"), "--prompts", "prompts file", folder=False)
    check_readable(given("target"), "--target", "target checkpoint folder", folder=True)
    if getattr(args, "builder", None) != "none":
        check_readable(given("drafter"), "--drafter", "drafter checkpoint folder",
                       folder=True)
    if getattr(args, "budget", None) == "auto":  # else decode_config refuses --tuning
        check_readable(getattr(args, "tuning", None), "--tuning", "tuning file",
                       folder=False)


def checkpoint_dirs(args) -> tuple[str, str | None, str]:
    """(target dir, drafter dir or None, description) from the flags and the bundle.

    ``--target`` unset, ``bundled`` or the bundled target's folder is the bundled target;
    ``--drafter bundled:NAME`` (or ``bundled``) picks one of the bundled drafters (with the
    bundled target); no ``--drafter`` means the bundled default (ExitTrain).
    """
    from tev_jax.models.bundled import (BUNDLED, DEFAULT_DRAFTER, bundled_paths,
                                        check_drafter_name, is_bundled_target)

    if is_bundled_target(args.target):
        args.target = None
    if args.drafter == BUNDLED:
        args.drafter = BUNDLED_PREFIX + DEFAULT_DRAFTER
    needs_drafter = args.builder != "none"
    name = None
    if args.drafter is None or args.drafter.startswith(BUNDLED_PREFIX):
        name = DEFAULT_DRAFTER if args.drafter is None else args.drafter[len(BUNDLED_PREFIX):]
        check_drafter_name(name)
    if args.target is None:
        paths = bundled_paths(drafters=(name,) if needs_drafter and name else ())
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


def _budget(text: str) -> int | str:
    """``--budget``: a positive int, or 'auto' (with ``--tuning``)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int or 'auto', got {text!r}") from None


def add_decode_flags(p, *, max_new_tokens: int = 256, tree: bool = True) -> None:
    """The flags of a `DecodeConfig` (the builder and verifier choices are the
    registries' names); ``tree=False`` leaves out the tree's (builder, budget, tuning)."""
    if tree:
        add_tree_flags(p)
    p.add_argument("--verifier", choices=VERIFIER_NAMES, default="tev",
                   help="exact tree verifier (default %(default)s; greedy: T = 0 only)")
    add_sampling_flags(p, temperature=0.0)
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                   help="at most this many (default %(default)s); stops at <|end|> / <|eos|>")
    p.add_argument("--prefill-chunk", type=int, default=512,
                   help="prefill the prompt in chunks of this many tokens (bounded memory; "
                        "default %(default)s)")


def add_tree_flags(p) -> None:
    """The tree's flags of `add_decode_flags` (builder, budget, tuning)."""
    p.add_argument("--builder", choices=BUILDER_NAMES, default="ddtree",
                   help="ddtree (default), chain (plain DFlash) or none (autoregressive)")
    p.add_argument("--budget", type=_budget, default=64,
                   help="DDTree node budget (default %(default)s), or auto: the best budget "
                        "for the batch size from --tuning (plain AR where that is faster)")
    p.add_argument("--tuning", default=None, metavar="FILE",
                   help="with --budget auto: a tuning file of `tev-jax tune --json FILE`")


def decode_config(args, **fields) -> DecodeConfig:
    """The `DecodeConfig` of `add_decode_flags`'s flags (the tree's at their defaults
    where the command has none); ``fields`` override or add."""
    from tev_jax.decode import DecodeConfig

    tree = {k: getattr(args, k) for k in ("builder", "budget", "tuning") if hasattr(args, k)}
    if tree.get("tuning") is not None and tree["budget"] != "auto":
        raise ValueError("--tuning is read with --budget auto")
    if tree.get("budget") == "auto" and tree.get("tuning") is None:
        raise ValueError("--budget auto needs --tuning FILE (the file that tev-jax tune "
                         "--json FILE writes)")
    return DecodeConfig(**tree | {
        "max_new_tokens": args.max_new_tokens, "verifier": args.verifier,
        "sampling": sampling_from(args), "prefill_chunk": args.prefill_chunk} | fields)


def method_label(config: DecodeConfig, auto: str | None = None) -> str:
    how = "" if auto is None else f", auto from {auto}"
    if config.builder == "none":
        return f"autoregressive{how}"
    budget = f" (budget {config.budget}{how})" if config.builder == "ddtree" else ""
    return f"{config.builder}{budget} + {config.verifier}"


def add_mesh_flags(p) -> None:
    for axis, what in (("data", "batch rows; weights whole on every device"),
                       ("fsdp", "batch rows and the weights' embed axis"),
                       ("tensor", "heads, MLP and vocabulary")):
        p.add_argument(f"--mesh-{axis}", type=int, default=1,
                       help=f"devices on the {axis} mesh axis ({what}; default 1)")


def mesh_from(args):
    """The ('data', 'fsdp', 'tensor') mesh of the flags, or None for one device; a mesh
    larger than the devices is refused with the way to simulate devices on CPU."""
    import jax

    from tev_jax import sharding as shd

    axes = (args.mesh_data, args.mesh_fsdp, args.mesh_tensor)
    if axes == (1, 1, 1):
        return None
    try:
        return shd.make_mesh(*axes)
    except ValueError as e:
        if jax.default_backend() != "cpu":
            raise
        raise ValueError(f"{e} (on CPU simulate devices with XLA_FLAGS="
                         "--xla_force_host_platform_device_count=8)") from e
