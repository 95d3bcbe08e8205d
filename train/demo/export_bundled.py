"""Exports the demo target and its two drafters into the package, so ``tev-jax generate``
needs no paths::

    python -m train.demo.export_bundled --target runs/target/hf \
        --exittrain runs/exit_recipe/<chosen>/drafter --dflash runs/drafters/dflash/drafter

Writes ``tev_jax/data/models/`` (the layout of `tev_jax.models.bundled`) as one
directory, assembled in a temporary sibling and renamed into place only once complete
and checked: the weights are stored as trained (float32; ``--dtype bfloat16`` halves
the size at some cost in fidelity), the target directory gets the
tokenizer, a ``tokenizer_config.json`` (special tokens, chat template) and a
``generation_config.json``, both get a README (model card), and ``manifest.json`` pins
the SHA-256 of every file. The export refuses (ValueError) a bundle above 40 MB and
leaves the previous bundle untouched.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tev_jax.data import tokenizer as tok_lib
from tev_jax.models import bundled
from tev_jax.models.checkpoint_io import (
    load_target, load_tokenizer, save_target, tokenizer_vocab_size, write_atomically,
)
from tev_jax.models.drafter_io import load_drafter, save_drafter
from tev_jax.models.target import score

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "tev_jax" / "data" / "models"
_score = jax.jit(score)
PROBE_TEXT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'

# One user turn renders as tev_jax.data.format_chat, a user + assistant pair as
# format_chat_turn; turns after the first are separated by a newline. Newlines are
# written as {{ '\\n' }} expressions because transformers renders with trim_blocks (a
# newline right after a block tag is dropped).
_NL = "{{ '\\n' }}"
_NL2 = "'\\n\\n'"
# Leading system messages open the first user turn, joined by blank lines and a blank
# line before the user's text (the tokenizer has no system token;
# `tev_jax.data.tokenizer.format_chat` writes the same); without them, a user turn renders
# exactly as the drafters were trained on it.
CHAT_TEMPLATE = (
    "{% set ns = namespace(system='', n=0) %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and ns.n == loop.index0 %}"
    "{% set ns.system = ns.system + (" + _NL2 + " if ns.system else '') + message['content'] %}"
    "{% set ns.n = ns.n + 1 %}{% endif %}{% endfor %}"
    "{% set turns = messages[ns.n:] %}"
    "{% if not turns or (ns.n and turns[0]['role'] != 'user') %}"
    "{{ raise_exception('system messages must be followed by a user turn') }}{% endif %}"
    "{% for message in turns %}"
    "{% if not loop.first %}" + _NL + "{% endif %}"
    "{% if message['role'] == 'user' %}" + tok_lib.USER + _NL
    + "{% if loop.first and ns.system %}{{ ns.system }}" + _NL + _NL + "{% endif %}"
    "{{ message['content'] }}" + tok_lib.END
    + "{% elif message['role'] == 'assistant' %}" + tok_lib.ASSISTANT + _NL
    + "{{ message['content'] }}" + tok_lib.END
    + "{% else %}{{ raise_exception('system messages come first, then user and assistant "
    "turns') }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}" + _NL + tok_lib.ASSISTANT + _NL + "{% endif %}"
)

LICENCE_TEXT = """\
## Licence and data

The weights are released under the Apache License 2.0, like tev-jax (`LICENSE`). They
were trained only on the project's offline corpus: the documents, their sources and
licences are listed in `tev_jax/data/README.md`; the evaluation prompts (never trained
on) and their licences in `tev_jax/data/prompts/README.md`. Cite those sources when you
publish results obtained with these weights.
"""


def tokenizer_config(model_max_length: int) -> dict[str, Any]:
    """The Hugging Face ``tokenizer_config.json`` of the bundled tokenizer."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok_lib.BOS,
        "eos_token": tok_lib.EOS,
        "pad_token": tok_lib.PAD,
        "mask_token": tok_lib.MASK,
        "additional_special_tokens": [tok_lib.USER, tok_lib.ASSISTANT, tok_lib.END],
        "model_max_length": int(model_max_length),
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def _special_ids() -> dict[str, Any]:
    return {"bos_token_id": tok_lib.BOS_ID, "eos_token_id": list(tok_lib.STOP_IDS),
            "pad_token_id": tok_lib.PAD_ID}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _last_record_with(log: Path, key: str) -> dict[str, Any] | None:
    if not log.is_file():
        return None
    found = None
    for line in log.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and key in record:
            found = record
    return found


def _num_params(module: nnx.Module) -> int:
    return sum(int(np.prod(v.get_value().shape))
               for _, v in nnx.to_flat_state(nnx.state(module, nnx.Param)))


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:.1f} MB"


def _json_block(obj: Any) -> str:
    return "```json\n" + json.dumps(obj, indent=2) + "\n```\n"


def target_readme(target, source: Path, weight_bytes: int, stored: str = "float32") -> str:
    """The target's model card: what it is, how it was trained, licence."""
    c = target.config
    train_cfg = _read_json(source.parent / "train_config.json")
    val = _last_record_with(source.parent / "log.jsonl", "val")
    rows = [
        ("architecture", f"Qwen3: {c.num_layers} layers, D = {c.hidden_size}, {c.num_heads} "
                         f"query / {c.num_kv_heads} key-value heads of {c.head_dim}, SwiGLU "
                         f"{c.intermediate_size}, "
                         f"{'tied' if c.tie_word_embeddings else 'untied'} embeddings, "
                         f"RoPE θ = {c.rope_theta:g}"),
        ("parameters", f"{c.num_params / 1e6:.2f} M"),
        ("vocabulary", f"V = {c.vocab_size}, byte-level BPE (`tokenizer.json`, the tokenizer "
                       "of `tev_jax/data/tokenizer.json`)"),
        ("weights", f"{stored}, `model.safetensors` ({_mb(weight_bytes)})"),
    ]
    if isinstance(train_cfg, dict) and "seq_len" in train_cfg:
        rows.append(("context", f"trained on {train_cfg['seq_len']}-token windows "
                                f"(config allows {c.max_position_embeddings})"))
    table = "| | |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)
    if val is not None:
        losses = val["val"]
        loss_text = (f"Held-out next-token loss (nats/token) at step {val.get('step')}:\n\n"
                     "| " + " | ".join(losses) + " |\n|" + "---|" * len(losses) + "\n| "
                     + " | ".join(f"{v:.3f}" for v in losses.values()) + " |\n")
    else:
        loss_text = f"Held-out loss: no evaluation record found next to `{source}`.\n"
    config_text = ("The training configuration (`train_config.json` of the run):\n\n"
                   + _json_block(train_cfg)) if train_cfg is not None else ""
    return f"""---
license: apache-2.0
library_name: tev-jax
tags: [qwen3, speculative-decoding, demo]
---

# tev-jax demo target

A small Qwen3-architecture language model trained from scratch on the 2-core CPU of the
development machine, shipped so that `tev-jax generate "def fibonacci(n):"` works offline
right after `pip install`. It is the target of the speculative-decoding demo, not a
useful assistant: it writes plausible-looking Python, prose and arithmetic that is often
wrong.

{table}
{loss_text}
## Use

```bash
tev-jax generate "def fibonacci(n):"
```

```python
from tev_jax.models import load_bundled
target, drafter, tokenizer = load_bundled()
```

transformers reads this directory as it is (`AutoModelForCausalLM`, `AutoTokenizer`; the
chat template of `tokenizer_config.json` is `tev_jax.data.format_chat`). Generation stops
at `<|end|>` or `<|eos|>` (`generation_config.json`).

## Training

Reproduce (commands and outputs: `train/README.md`, `tev_jax/data/README.md`):

```bash
python -m train.demo.prepare_corpus --update-bundled                  # corpus, tokenizer
python -m train.demo.train_target --out runs/target                   # -> runs/target/hf
{bundled.EXPORT_COMMAND}
```

or every stage of the demo models at once, with their settings:
`python -m train.demo.build` (`train/demo/build.py`).

{config_text}
Exported from `{source}` by `train/demo/export_bundled.py` ({_conversion(stored)}).

{LICENCE_TEXT}"""


_DRAFTER_INTRO = {
    "exittrain": ("ExitTrain", """\
The DFlash block-diffusion drafter of the bundled target, fine-tuned with Exit-Guided
Draft-Tree Training (ExitTrain) from the bundled token-only drafter (`../dflash`): it
proposes {h} tokens per round from the target's hidden states, a DDTree is built from its
per-depth distributions, and the target verifies the tree with TEV."""),
    "dflash": ("DFlash, token objective", """\
The DFlash block-diffusion drafter of the bundled target, trained with the token
objective only (DDTree's drafter, and the starting point of the bundled ExitTrain drafter
`../exittrain`): it proposes {h} tokens per round from the target's hidden states, a
DDTree is built from its per-depth distributions, and the target verifies the tree (with
predraw in the DDTree method, or TEV)."""),
}


def drafter_readme(drafter, source: Path, target_source: Path, weight_bytes: int,
                   stored: str = "float32", name: str = bundled.DEFAULT_DRAFTER) -> str:
    """The model card of bundled drafter ``name``: what it is, how it was trained, licence."""
    c = drafter.config
    run_cfg = _read_json(source.parent / "config.json")
    last = _last_record_with(source.parent / "train_log.jsonl", "tau")
    rows = [
        ("architecture", f"DFlash block drafter: {c.model.num_layers} Qwen3 "
                         f"layer{'s' if c.model.num_layers > 1 else ''} "
                         f"(D = {c.model.hidden_size}), block size {c.block_size} "
                         f"(horizon H = {c.block_size - 1}), reads target layers "
                         f"{list(c.target_layer_ids)}; MASK token id {c.mask_token_id}"),
        ("parameters", f"{_num_params(drafter) / 1e6:.2f} M (embedding and LM head are "
                       "the target's)"),
        ("weights", f"{stored}, `model.safetensors` ({_mb(weight_bytes)})"),
        ("target", "the bundled target (`../../target`); it fits no other model"),
    ]
    if isinstance(run_cfg, dict):
        objective = run_cfg.get("objective", "exittrain")
        if objective == "opd":
            text = (f"Draft-OPD (`--objective opd`): rollouts of budget {run_cfg.get('budget')} "
                    f"at T = {run_cfg.get('opd_temperature')}, refreshed every "
                    f"{run_cfg.get('opd_steps')} updates")
        else:   # configs before --objective spell the token objective loss 'token'
            loss = "token" if objective == "token" else run_cfg.get("loss")
            text = (f"loss `{loss}`, DDTree budget {run_cfg.get('budget')}, "
                    f"λ = {run_cfg.get('exit_lambda')}")
        rows.append(("objective", text))
    table = "| | |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)
    tau_text = (f"Last logged training-tree τ (1 + coverage, update {last.get('update', '?')}): "
                f"{last['tau']:.3f}.\n" if last is not None and last.get("tau") is not None
                else "")
    config_text = ("The flags of the training run (`config.json` of the run):\n\n"
                   + _json_block(run_cfg)) if run_cfg is not None else ""
    title, intro = _DRAFTER_INTRO[name]
    return f"""---
license: apache-2.0
library_name: tev-jax
tags: [dflash, speculative-decoding, exittrain, demo]
---

# tev-jax demo drafter ({title})

{intro.format(h=c.block_size - 1)} The verifiers are exact, so the output follows the
target's distribution (at T = 0 it is the target's greedy text); the drafter only decides
the speed.

{table}
{tau_text}
## Use

```bash
tev-jax generate "def fibonacci(n):" --drafter bundled:{name} --compare-ar
tev-jax compare "def fibonacci(n):"     # AR, DFlash + DDTree + predraw, ExitTrain + TEV
```

```python
from tev_jax.models import load_bundled
target, drafter, tokenizer = load_bundled(drafter="{name}")
```

## Training

Target rollouts, then the DFlash token objective and the ExitTrain fine-tune
(`python -m train rollouts ...`, `python -m train run ...`; the steps and their flags are
in `train/README.md`, the fine-tune's choice in `experiments/exit_recipe/README.md`), then

```bash
{bundled.EXPORT_COMMAND}
```

`python -m train.demo.build` (`train/demo/build.py`) runs every stage with the settings
of the shipped models.

{config_text}
Exported from `{source}` (target `{target_source}`) by `train/demo/export_bundled.py`
({_conversion(stored)}).

{LICENCE_TEXT}"""


def _conversion(stored: str) -> str:
    return ("weights as trained" if stored == "float32"
            else f"float32 → {stored}, round to nearest even")


def _logit_check(original, bundle_dir: Path, tokenizer):
    """(max |Δ logit| and top-1 agreement of the bundled target vs the original on a
    probe, the bundled target)."""
    ids = np.asarray([tokenizer.encode(PROBE_TEXT).ids], np.int32)
    reloaded = load_target(bundle_dir)
    ref = np.asarray(_score(original, ids))
    got = np.asarray(_score(reloaded, ids))
    if not np.isfinite(got).all():
        raise ValueError("the exported target produces non-finite logits")
    check = {"probe_tokens": int(ids.shape[1]),
             "max_abs_logit_diff": float(np.abs(got - ref).max()),
             "top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).mean())}
    return check, reloaded


def export_bundle(target_dir: str | Path, drafter_dirs: Mapping[str, str | Path],
                  out: str | Path = DEFAULT_OUT, *, max_bytes: int = bundled.MAX_BUNDLE_BYTES,
                  dtype=jnp.float32) -> dict[str, Any]:
    """Writes the bundle (target + drafters, ``dtype`` weights, manifest) to ``out``.

    Args:
      target_dir: Hugging Face target directory with the project's ``tokenizer.json``.
      drafter_dirs: {name: DFlash drafter directory made for that target} for every name
        of `tev_jax.models.bundled.DRAFTERS` ('exittrain', 'dflash').
      out: the bundle directory, replaced atomically (default the package's
        ``tev_jax/data/models``).
      max_bytes: refuse a bundle larger than this (all files together).
      dtype: stored weight dtype.
    Returns:
      The manifest dict.
    Raises:
      ValueError: unreadable or mismatched checkpoints, other drafter names, a tokenizer
        without the project's special tokens, or a bundle above ``max_bytes``; ``out``
        is then left as it was.
    """
    if set(drafter_dirs) != set(bundled.DRAFTERS):
        raise ValueError(f"the bundle ships the drafters {bundled.DRAFTERS}, got "
                         f"{sorted(drafter_dirs)}")
    target_dir = Path(target_dir)
    drafter_dirs = {name: Path(drafter_dirs[name]) for name in bundled.DRAFTERS}
    tok_file = target_dir / "tokenizer.json"
    if not tok_file.is_file():
        raise ValueError(f"{target_dir}: no tokenizer.json (the bundle ships the target's "
                         "tokenizer)")
    tokenizer = load_tokenizer(target_dir)
    tok_lib.check_special_tokens(tokenizer)
    target = load_target(target_dir)
    drafters = {name: load_drafter(d, target) for name, d in drafter_dirs.items()}
    stored = jnp.dtype(dtype).name

    def write(tmp: Path) -> None:
        t_dir = tmp / bundled.TARGET_DIR
        save_target(target, t_dir, dtype=dtype)
        config = json.loads((t_dir / "config.json").read_text())
        config.update(_special_ids())
        (t_dir / "config.json").write_text(json.dumps(config, indent=2))
        (t_dir / "generation_config.json").write_text(json.dumps(
            {**_special_ids(), "do_sample": False}, indent=2))
        shutil.copyfile(tok_file, t_dir / "tokenizer.json")
        (t_dir / "tokenizer_config.json").write_text(json.dumps(
            tokenizer_config(target.config.max_position_embeddings), indent=2))
        t_bytes = (t_dir / "model.safetensors").stat().st_size
        (t_dir / "README.md").write_text(target_readme(target, target_dir, t_bytes, stored))
        for name, drafter in drafters.items():
            d_dir = tmp / bundled.DRAFTERS_DIR / name
            save_drafter(drafter, d_dir, dtype=dtype)
            d_bytes = (d_dir / "model.safetensors").stat().st_size
            (d_dir / "README.md").write_text(drafter_readme(
                drafter, drafter_dirs[name], target_dir, d_bytes, stored, name))
        total = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file())
        if total > max_bytes:
            raise ValueError(f"the bundle is {_mb(total)} ({total} bytes), above the "
                             f"{_mb(max_bytes)} limit: ship smaller models")
        check, reloaded = _logit_check(target, t_dir, tokenizer)
        for name in drafters:
            load_drafter(tmp / bundled.DRAFTERS_DIR / name, reloaded)
        bundled.write_manifest(tmp, {
            "dtype": stored,
            "target": {"source": str(target_dir), "params": target.config.num_params,
                       "vocab_size": target.config.vocab_size},
            "drafters": {name: {"source": str(drafter_dirs[name]), "params": _num_params(d),
                                "block_size": d.config.block_size,
                                "mask_token_id": d.config.mask_token_id,
                                "target_layer_ids": list(d.config.target_layer_ids)}
                         for name, d in drafters.items()},
            "tokenizer": {"sha256": tok_lib.tokenizer_sha256(tokenizer),
                          "vocab_size": tokenizer_vocab_size(tokenizer)},
            "check": check,
        })
        bundled.verify_bundle(tmp)
        for path in (tmp, *tmp.rglob("*")):  # temporary folders are private (0700)
            path.chmod(0o755 if path.is_dir() else 0o644)

    write_atomically(out, write)
    return bundled.verify_bundle(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="Hugging Face target directory")
    p.add_argument("--exittrain", required=True,
                   help="the ExitTrain drafter's directory (the bundle's default drafter)")
    p.add_argument("--dflash", required=True,
                   help="the token-only DFlash drafter's directory (DDTree's drafter)")
    p.add_argument("--out", default=str(DEFAULT_OUT),
                   help="bundle directory (default: the package's tev_jax/data/models)")
    p.add_argument("--max-mb", type=float, default=bundled.MAX_BUNDLE_BYTES / 1e6,
                   help="refuse a bundle above this many MB (10^6 bytes)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="stored weight dtype (default: as trained)")
    args = p.parse_args(argv)
    try:
        manifest = export_bundle(args.target, {"exittrain": args.exittrain,
                                               "dflash": args.dflash}, args.out,
                                 max_bytes=int(args.max_mb * 1e6), dtype=args.dtype)
    except ValueError as e:
        p.error(str(e))
    total = sum(f["bytes"] for f in manifest["files"].values())
    drafters = ", ".join(f"{k} {v['params'] / 1e6:.2f} M"
                         for k, v in manifest["drafters"].items())
    print(f"wrote {args.out}: {len(manifest['files'])} pinned files, {_mb(total)}; target "
          f"{manifest['target']['params'] / 1e6:.2f} M params, drafters {drafters}; "
          f"{manifest['dtype']} vs float32 "
          f"logits: max |Δ| {manifest['check']['max_abs_logit_diff']:.4f}, top-1 agreement "
          f"{manifest['check']['top1_agreement']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
