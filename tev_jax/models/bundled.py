"""The demo models that ship inside the package: where they are, and are they intact.

``tev_jax/data/models/`` (written by ``python -m train.demo.export_bundled``)::

    manifest.json         format, dtype, and the SHA-256 and size of every file below
                          except the READMEs
    target/               Hugging Face layout: config.json, generation_config.json,
                          model.safetensors (float32), tokenizer.json,
                          tokenizer_config.json, README.md
    drafters/exittrain/   the ExitTrain drafter (the default), DFlash layout:
                          config.json, model.safetensors (float32), README.md
    drafters/dflash/      the token-only DFlash drafter it was fine-tuned from (DDTree's
                          drafter), same layout

`bundled_paths` finds the directories through ``importlib.resources`` (so it works from
an installed wheel as well as from a checkout) and, by default, checks every file
against the manifest first, so a truncated or corrupted install fails with a message
naming the file instead of loading garbage weights.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple

import jax.numpy as jnp

BUNDLED = "bundled"  # the name that picks the bundled models on the command line
MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 2
TARGET_DIR, DRAFTERS_DIR = "target", "drafters"
# The bundled drafters of the one target: ExitTrain (for TEV) first, the default.
DRAFTERS = ("exittrain", "dflash")
DEFAULT_DRAFTER = DRAFTERS[0]
# Bundles are small by design: the repository and the wheel stay light.
MAX_BUNDLE_BYTES = 40 * 1000**2
EXPORT_COMMAND = ("python -m train.demo.export_bundled --target tev_jax/data/models/target "
                  "--exittrain runs/exit_recipe/<chosen>/drafter "
                  "--dflash runs/drafters/dflash/drafter")
# Free-text files the manifest does not pin, so their text can be edited after export.
UNPINNED_NAMES = ("README.md",)


class BundledPaths(NamedTuple):
    """The bundled checkpoint directories (`load_target` / `load_drafter` read them).

    ``target`` is the target's directory and ``drafters`` maps the name of every bundled
    drafter (`DRAFTERS`) to its directory.
    """

    target: Path
    drafters: dict[str, Path]

    @property
    def drafter(self) -> Path:
        """The default (ExitTrain) drafter's directory."""
        return self.drafters[DEFAULT_DRAFTER]


def bundle_root() -> Path:
    """``tev_jax/data/models`` of the imported package (it may not exist)."""
    return Path(str(resources.files("tev_jax.data").joinpath("models")))


def file_sha256(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes (read in 1 MiB chunks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def pinned_files(root: str | os.PathLike) -> list[str]:
    """Relative POSIX paths of the files under ``root`` that a manifest pins (sorted)."""
    root = Path(root)
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.is_file() and p.name not in UNPINNED_NAMES and p.name != MANIFEST_FILE
                  and not any(part.startswith(".") for part in p.relative_to(root).parts))


def write_manifest(root: str | os.PathLike, info: Mapping[str, Any]) -> dict[str, Any]:
    """Writes ``root/manifest.json``: ``info`` plus the SHA-256 and size of every pinned file.

    Returns:
      The manifest dict.
    """
    root = Path(root)
    files = {rel: {"sha256": file_sha256(root / rel), "bytes": (root / rel).stat().st_size}
             for rel in pinned_files(root)}
    manifest = {"format": MANIFEST_FORMAT, **info, "files": files}
    (root / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _missing(root: Path, what: str) -> ValueError:
    return ValueError(
        f"the bundled demo models are missing ({what} in {root}). Create them from a "
        f"repository checkout with `{EXPORT_COMMAND}` (see train/README.md) and "
        "reinstall, or pass your own checkpoints with --target and --drafter")


def verify_bundle(root: str | os.PathLike, *, drafters: tuple[str, ...] | None = None
                  ) -> dict[str, Any]:
    """Checks a bundle directory against its manifest.

    Args:
      root: the bundle directory (``manifest.json``, ``target/``, ``drafter/``).
      drafters: check only these drafters' files besides the target's (default: every
        file), so that damage to one drafter does not block the other.
    Returns:
      The manifest dict.
    Raises:
      ValueError: no manifest (the message names the export command), an unreadable
        manifest, or a pinned file that is missing, has another size or another SHA-256.
    """
    root = Path(root)
    f = root / MANIFEST_FILE
    if not f.is_file():
        raise _missing(root, f"no {MANIFEST_FILE}")
    try:
        manifest = json.loads(f.read_text())
        fmt = manifest["format"]
        files = {str(rel): {"bytes": int(w["bytes"]), "sha256": str(w["sha256"])}
                 for rel, w in manifest["files"].items()}
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError,
            AttributeError) as e:
        raise ValueError(f"{f}: malformed bundle manifest ({e!r}); re-export with "
                         f"`{EXPORT_COMMAND}`") from e
    if fmt != MANIFEST_FORMAT:
        raise ValueError(f"{f}: bundle manifest format {fmt!r}, this tev-jax reads "
                         f"{MANIFEST_FORMAT}")
    subs = (TARGET_DIR, *(f"{DRAFTERS_DIR}/{d}" for d in
                          (DRAFTERS if drafters is None else drafters)))
    for sub in subs:
        if not (root / sub).is_dir():
            raise _missing(root, f"no {sub}/ directory")
    if drafters is not None:
        files = {rel: w for rel, w in files.items()
                 if any(rel.startswith(sub + "/") for sub in subs)}
    for rel, want in files.items():
        p = root / rel
        if not p.is_file():
            raise ValueError(f"bundled model file {rel} is missing from {root}; reinstall "
                             f"tev-jax or re-export with `{EXPORT_COMMAND}`")
        size = p.stat().st_size
        if size != want["bytes"]:
            raise ValueError(f"bundled model file {p} is corrupted: {size} bytes, the "
                             f"manifest says {want['bytes']} (truncated or replaced?); "
                             f"reinstall tev-jax or re-export with `{EXPORT_COMMAND}`")
        got = file_sha256(p)
        if got != want["sha256"]:
            raise ValueError(f"bundled model file {p} is corrupted: sha256 {got[:16]}..., "
                             f"the manifest says {want['sha256'][:16]}...; reinstall "
                             f"tev-jax or re-export with `{EXPORT_COMMAND}`")
    return manifest


def bundled_paths(root: str | os.PathLike | None = None, *, verify: bool = True,
                  drafters: tuple[str, ...] | None = None) -> BundledPaths:
    """The bundled target and drafter directories.

    Args:
      root: the bundle directory (default: `bundle_root`, inside the installed package).
      verify: check every pinned file's size and SHA-256 against the manifest first
        (about 10 ms per 8 MB).
      drafters: verify only the target and these drafters (default: all of them).
    Returns:
      `BundledPaths` (target, drafters by name).
    Raises:
      ValueError: the bundle is missing (the message names the command that creates
        it) or a file does not match the manifest.
    """
    root = bundle_root() if root is None else Path(root)
    if verify:
        verify_bundle(root, drafters=drafters)
    paths = BundledPaths(root / TARGET_DIR,
                         {d: root / DRAFTERS_DIR / d for d in DRAFTERS})
    needed = DRAFTERS if drafters is None else drafters
    for p in (paths.target, *(paths.drafters[d] for d in needed)):
        if not (p / "config.json").is_file():
            raise _missing(root, f"no {p.relative_to(root).as_posix()}/config.json")
    return paths


def check_drafter_name(drafter: str) -> None:
    """Raises ValueError unless ``drafter`` names a bundled drafter (`DRAFTERS`)."""
    if drafter not in DRAFTERS:
        raise ValueError(f"unknown bundled drafter {drafter!r}; the bundle ships {DRAFTERS}")


def load_bundled(*, drafter: str = DEFAULT_DRAFTER, dtype=jnp.float32,
                 root: str | os.PathLike | None = None):
    """Loads the bundled demo target and one of its drafters.

    Args:
      drafter: 'exittrain' (default: fine-tuned with ExitTrain, for TEV) or 'dflash'
        (the token-only DFlash drafter it started from, DDTree's drafter).
      dtype: parameter/activation dtype of both models (float32, as stored, computes
        fastest on CPU).
      root: the bundle directory (default: inside the installed package).
    Returns:
      (target, drafter, tokenizer): a `Target`, the DFlash `Drafter` and the
      `tokenizers.Tokenizer`.
    Raises:
      ValueError: an unknown drafter name, or see `bundled_paths`.
    """
    from tev_jax.models.checkpoint_io import load_target, load_tokenizer
    from tev_jax.models.drafter_io import load_drafter

    check_drafter_name(drafter)
    paths = bundled_paths(root, drafters=(drafter,))
    target = load_target(paths.target, dtype=dtype)
    return (target, load_drafter(paths.drafters[drafter], target),
            load_tokenizer(paths.target))


def is_bundled_target(target: str | None) -> bool:
    """Whether a target flag (``--target``) names the bundled target: unset,
    ``bundled``, or its folder."""
    if target is None or target == BUNDLED:
        return True
    try:
        return os.path.samefile(target, os.path.join(bundle_root(), "target"))
    except OSError:
        return False
