"""Hugging Face checkpoints on local disk: `load_target`, `save_target`, `load_tokenizer`.

Layout read and written (the one transformers uses for Qwen3ForCausalLM and
LlamaForCausalLM)::

    config.json
    model.safetensors                         (or model-0000k-of-0000n.safetensors
    model.safetensors.index.json               + the index, when sharded)
    tokenizer.json                            (optional; checked against vocab_size)

Tensor names: ``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.{q,k,v,o}_proj
.{weight,bias}``, ``model.layers.{i}.self_attn.{q,k}_norm.weight`` (Qwen3),
``model.layers.{i}.mlp.{gate,up,down}_proj.weight``, ``model.layers.{i}.input_layernorm
.weight``, ``model.layers.{i}.post_attention_layernorm.weight``, ``model.norm.weight``,
``lm_head.weight`` (untied only).

Loading first reads every file's header and checks names and shapes against the
config, so a missing, extra or misshapen tensor fails before anything is loaded. Then
each tensor is read once, converted once (transpose / reshape / cast on the host) and
placed straight into its final sharding with ``jax.make_array_from_callback``: no
second full host copy of the weights ever exists.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from tev_jax import sharding as shd
from tev_jax.models.config import ModelConfig
from tev_jax.models.target import Target

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
# Buffers some older checkpoints carry; never parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ------------------------------------------------------------------- name mapping


def _hf_name(path: tuple) -> tuple[str, int]:
    """(HF tensor name, n_in) for a parameter path.

    n_in: kernels contract their first n_in axes (HF stores them transposed and
    flattened to [out, in]); 0 = same layout as HF; -1 = a bias, flattened in HF.
    """
    if path == ("embed_tokens",):
        return "model.embed_tokens.weight", 0
    if path == ("lm_head",):
        return "lm_head.weight", 1
    if path == ("norm", "weight"):
        return "model.norm.weight", 0
    if path[0] == "layers":
        i, rest = path[1], path[2:]
        if rest[-1] == "kernel":
            n_in = 2 if rest[-2] == "o_proj" else 1
            return f"model.layers.{i}." + ".".join(rest[:-1]) + ".weight", n_in
        return f"model.layers.{i}." + ".".join(str(r) for r in rest), (
            -1 if rest[-1] == "bias" else 0)
    raise ValueError(f"no Hugging Face name for parameter {'/'.join(map(str, path))}")


def _hf_shape(shape: tuple[int, ...], n_in: int) -> tuple[int, ...]:
    if n_in == 0:
        return tuple(shape)
    if n_in == -1:
        return (math.prod(shape),)
    return (math.prod(shape[n_in:]), math.prod(shape[:n_in]))


def _to_ours(w: np.ndarray, shape: tuple[int, ...], n_in: int) -> np.ndarray:
    """PyTorch layout -> ours; views only (no copy) where numpy allows."""
    return w.reshape(shape) if n_in <= 0 else w.T.reshape(shape)


def _to_hf(w: np.ndarray, n_in: int) -> np.ndarray:
    if n_in == 0:
        return np.ascontiguousarray(w)
    if n_in == -1:
        return np.ascontiguousarray(w.reshape(-1))
    return np.ascontiguousarray(w.reshape(math.prod(w.shape[:n_in]), -1).T)


def param_names(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> expected HF shape for a config (what a checkpoint must hold)."""
    abstract = nnx.eval_shape(lambda: Target(config, rngs=nnx.Rngs(0)))
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        name, n_in = _hf_name(path)
        out[name] = _hf_shape(var.get_value().shape, n_in)
    return out


# ---------------------------------------------------------------------- config io


def read_config(path: str | os.PathLike) -> ModelConfig:
    """`ModelConfig` from ``path/config.json`` (ValueError if absent or malformed)."""
    f = Path(path) / "config.json"
    if not f.is_file():
        raise ValueError(f"{path}: no config.json")
    try:
        hf = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{f}: not valid JSON ({e})") from e
    if not isinstance(hf, dict):
        raise ValueError(f"{f}: expected a JSON object")
    return ModelConfig.from_hf(hf)


# ------------------------------------------------------------------------ tokenizer


def load_tokenizer(path: str | os.PathLike):
    """A `tokenizers.Tokenizer` from ``tokenizer.json`` (a directory or the file)."""
    from tokenizers import Tokenizer

    p = Path(path)
    f = p / "tokenizer.json" if p.is_dir() else p
    if not f.is_file():
        raise ValueError(f"{path}: no tokenizer.json")
    try:
        return Tokenizer.from_file(str(f))
    except Exception as e:  # the Rust side raises plain Exceptions
        raise ValueError(f"{f}: cannot read tokenizer ({e})") from e


def tokenizer_vocab_size(tokenizer) -> int:
    """1 + the largest token id the tokenizer can produce (added tokens included)."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    return max(vocab.values()) + 1 if vocab else 0


def check_vocab(config: ModelConfig, tokenizer) -> None:
    n = tokenizer_vocab_size(tokenizer)
    if n > config.vocab_size:
        raise ValueError(
            f"vocab_size mismatch: the tokenizer has token ids up to {n - 1} but the "
            f"config's vocab_size is {config.vocab_size}"
        )


# -------------------------------------------------------------------------- loading


def _weight_files(path: Path) -> dict[str, list[str]]:
    """file -> tensor names it must hold (from the index), or {single file: []}."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: malformed index ({e})") from e
        files: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            files.setdefault(fname, []).append(name)
        return files
    if (path / SINGLE_FILE).is_file():
        return {SINGLE_FILE: []}
    found = sorted(p.name for p in path.glob("*.safetensors"))
    if len(found) == 1:
        return {found[0]: []}
    if not found:
        raise ValueError(f"{path}: no {SINGLE_FILE} and no {INDEX_FILE}")
    raise ValueError(f"{path}: several .safetensors files but no {INDEX_FILE}")


def _read_headers(path: Path) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """tensor name -> (file, shape, dtype), validating files and the index."""
    from safetensors import safe_open

    where: dict[str, tuple[str, tuple[int, ...], str]] = {}
    for fname, indexed in _weight_files(path).items():
        fp = path / fname
        if not fp.is_file():
            raise ValueError(f"{path}: index names missing file {fname}")
        try:
            with safe_open(str(fp), framework="numpy") as f:
                keys = list(f.keys())
                for k in keys:
                    sl = f.get_slice(k)
                    if k in where:
                        raise ValueError(f"tensor {k} appears in both {where[k][0]} and {fname}")
                    where[k] = (fname, tuple(sl.get_shape()), sl.get_dtype())
        except ValueError:
            raise
        except Exception as e:
            raise ValueError(f"{fp}: corrupt or unreadable safetensors file ({e})") from e
        for name in indexed:
            if name not in keys:
                raise ValueError(f"tensor {name}: listed in {INDEX_FILE} for {fname} "
                                 "but absent from that file")
    return where


def _check_tensors(config: ModelConfig, where: Mapping[str, tuple]) -> set[str]:
    """Raises on missing / extra / misshapen / non-float tensors; returns names to skip."""
    expected = param_names(config)
    skip = {n for n in where if n.endswith(_IGNORED_SUFFIXES)}
    if config.tie_word_embeddings and "lm_head.weight" in where:
        skip.add("lm_head.weight")  # some tied checkpoints store the shared matrix twice
    missing = sorted(set(expected) - set(where))
    if missing:
        raise ValueError(f"checkpoint is missing tensor(s): {', '.join(missing[:10])}"
                         + (f" (+{len(missing) - 10} more)" if len(missing) > 10 else ""))
    extra = sorted(set(where) - set(expected) - skip)
    if extra:
        raise ValueError(f"checkpoint has unexpected tensor(s): {', '.join(extra[:10])}"
                         + (f" (+{len(extra) - 10} more)" if len(extra) > 10 else ""))
    for name, shape in expected.items():
        got = where[name][1]
        if tuple(got) != tuple(shape):
            raise ValueError(f"tensor {name}: shape {tuple(got)}, expected {tuple(shape)}")
        if where[name][2] not in _FLOAT_DTYPES:
            raise ValueError(f"tensor {name}: dtype {where[name][2]}, expected a float type")
    return skip


def load_target(path: str | os.PathLike, *, dtype=jnp.float32, mesh: Mesh | None = None,
                rules: shd.Rules | None = None, check_tokenizer: bool = True) -> Target:
    """Loads a local Hugging Face checkpoint directory into a `Target`.

    Args:
      path: directory with config.json and safetensors weights.
      dtype: parameter/activation dtype (float32 or bfloat16).
      mesh: if given, every parameter is placed with the sharding its logical axes ask
        for (`tev_jax.sharding`); otherwise on the default device.
      rules: logical -> mesh axis rules (default `tev_jax.sharding.DEFAULT_RULES`).
      check_tokenizer: if ``tokenizer.json`` exists, require its ids < vocab_size.
    Returns:
      The model (config at ``.config``).
    Raises:
      ValueError: malformed config, unsupported architecture, corrupt files, missing /
        extra / misshapen tensors, tokenizer-vocabulary mismatch. Nothing is returned
        half-loaded.
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: not a directory")
    config = read_config(path)
    if check_tokenizer and (path / "tokenizer.json").is_file():
        check_vocab(config, load_tokenizer(path))
    where = _read_headers(path)
    _check_tensors(config, where)

    abstract = nnx.eval_shape(lambda: Target(config, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, abs_state = nnx.split(abstract)
    if mesh is not None:
        shardings = nnx.to_flat_state(shd.state_shardings(abs_state, mesh, rules))
        sharding_of = {p: v.get_value() for p, v in shardings}
    else:
        dev = SingleDeviceSharding(jax.devices()[0])
        sharding_of = None

    by_file: dict[str, list] = {}
    for p, var in nnx.to_flat_state(abs_state):
        name, n_in = _hf_name(p)
        by_file.setdefault(where[name][0], []).append((p, var, name, n_in))

    leaves = []
    for fname, items in by_file.items():
        try:
            with safe_open(str(path / fname), framework="numpy") as f:
                for p, var, name, n_in in items:
                    aval = var.get_value()
                    w = _to_ours(f.get_tensor(name), aval.shape, n_in)
                    w = w.astype(aval.dtype, copy=False)
                    s = dev if sharding_of is None else sharding_of[p]
                    arr = jax.make_array_from_callback(aval.shape, s, lambda idx, w=w: w[idx])
                    leaves.append((p, var.replace(arr)))
                    del w
        except ValueError:
            raise
        except Exception as e:
            raise ValueError(f"{path / fname}: cannot read tensor data ({e})") from e
    state = nnx.from_flat_state(leaves)
    return nnx.merge(graphdef, state)


# --------------------------------------------------------------------------- saving


def save_target(model: Target, path: str | os.PathLike, *, tokenizer=None,
                max_shard_bytes: int = 4 << 30) -> None:
    """Writes ``model`` as a Hugging Face checkpoint directory at ``path``.

    The directory is assembled in a temporary sibling and renamed into place, so a
    failed save never leaves a half-written ``path`` (an existing one is replaced only
    after the new one is complete).

    Args:
      model: a `Target`.
      path: output directory.
      tokenizer: optional `tokenizers.Tokenizer`, written as tokenizer.json.
      max_shard_bytes: above this size the weights are split into several files with
        a ``model.safetensors.index.json``.
    """
    from safetensors.numpy import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path}: exists and is not a directory")
    config = model.config
    dtype_name = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}.get(
        jnp.dtype(model.dtype).name, "float32")

    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))
    try:
        (tmp / "config.json").write_text(json.dumps(config.to_hf(dtype=dtype_name), indent=2))
        # Group tensors into shards, fetching one at a time.
        params = [(p, v) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]
        shards: list[list] = [[]]
        size = 0
        for p, v in params:
            nbytes = v.get_value().size * v.get_value().dtype.itemsize
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((p, v))
            size += nbytes
        n = len(shards)
        weight_map = {}
        total = 0
        for k, shard in enumerate(shards):
            fname = SINGLE_FILE if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            tensors = {}
            for p, v in shard:
                name, n_in = _hf_name(p)
                tensors[name] = _to_hf(np.asarray(jax.device_get(v.get_value())), n_in)
                weight_map[name] = fname
                total += tensors[name].nbytes
            save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            del tensors
        if n > 1:
            (tmp / INDEX_FILE).write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        if tokenizer is not None:
            tokenizer.save(str(tmp / "tokenizer.json"))
        if path.exists():
            old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.old-"))
            os.rmdir(old)
            os.rename(path, old)
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
