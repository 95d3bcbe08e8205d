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
``lm_head.weight`` (untied only); a layer's other parameters are named by their path
(Gemma 4's ``model.layers.{i}.{pre,post}_feedforward_layernorm.weight``,
``model.layers.{i}.layer_scalar``). What a family stores differently, it names itself
(`tev_jax.models.registry.Family`: ``layer_tensor``, e.g. Qwen3-MoE's one tensor per
expert, ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``;
``checkpoint_prefix`` and ``foreign_tensors``, e.g. Gemma 4's unified checkpoint, whose
text weights sit under ``model.language_model.*`` beside vision / audio tensors that are
skipped). This module imports no family.

Loading first reads every file's header and checks names and shapes against the
config, so a missing, extra or misshapen tensor fails before anything is loaded. Then
each device's block of every tensor is read from a memory map (bfloat16 included,
through ``ml_dtypes``), converted (transpose / reshape / cast on the host) and placed
straight into its final sharding with ``jax.make_array_from_callback``: no full host
copy of the weights ever exists. The layers' parameters are stacked in the model
(``[layers, ...]``, `tev_jax.models.layers.stacked_layers`; experts ``[layers, E, ...]``)
and stored one tensor per layer (and expert), as transformers has them; each device
reads only the layers' and experts' tensors of its own block.

The shared pieces (`read_headers`, `expected_shapes`, `check_tensors`, `load_params`,
`save_params`, `write_atomically`) also serve the DFlash drafter (`drafter_io`): a
module only supplies ``name_of``, its parameter path -> (tensor name, n_in) map.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import math
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from tev_jax import sharding as shd
from tev_jax.models import registry
from tev_jax.models.config import ModelConfig
from tev_jax.models.target import Target

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# safetensors dtype codes -> numpy dtypes; the float ones are the loadable parameters.
FLOAT_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
                "BF16": ml_dtypes.bfloat16}
_NUMPY_DTYPES = {**FLOAT_DTYPES, "I64": np.int64, "I32": np.int32, "I16": np.int16,
                 "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16,
                 "U8": np.uint8, "BOOL": np.bool_}
# Buffers some older checkpoints carry; never parameters.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

NameOf = Callable[[tuple], tuple[str, int]]
"""Parameter path -> (tensor name, n_in).

n_in: kernels contract their first n_in axes (PyTorch stores them transposed and
flattened to [out, in]); 0 = same layout as PyTorch; -1 = a bias, flattened there.
A name with a ``{layer}`` field is a stacked parameter (`stacked_layers`): its leading
axis is the layer, stored as one tensor per layer (``model.layers.0.…``, ``….1.…``).
``{layer:P+J}`` is layer ``g·P + J`` at stack index g (sub-layer J of a `LayerPeriod` of
P layers); an ``{expert}`` field after it stacks the next axis over experts.
"""

LAYER_FIELD = "{layer}"
EXPERT_FIELD = "{expert}"
_STACK_FIELD = re.compile(r"\{(?:layer|expert)(?::(\d+)\+(\d+))?\}")


def stack_axes(name: str) -> int:
    """How many leading axes of a parameter are stacked in its tensor name's fields."""
    return len(_STACK_FIELD.findall(name))


def stacked_name(name: str, index: tuple[int, ...]) -> str:
    """The tensor name of one stacked block: the name's fields filled from ``index``."""
    it = iter(index)
    return _STACK_FIELD.sub(
        lambda m: str(next(it) * int(m.group(1) or 1) + int(m.group(2) or 0)), name)


class TensorInfo(NamedTuple):
    """Where a checkpoint tensor lives: its file, shape, dtype code and byte offset."""

    file: str
    shape: tuple[int, ...]
    dtype: str
    offset: int


# ------------------------------------------------------------------- name mapping


def layer_param_name(prefix: str, rest: tuple, period: int = 1,
                     layer_tensor=None) -> tuple[str, int]:
    """(name, n_in) of a decoder-layer parameter: ``rest`` is its path inside the layer.

    ``('self_attn', 'q_proj', 'kernel')`` -> ``prefix + 'self_attn.q_proj.weight'``; the
    prefix holds the `LAYER_FIELD` of stacked layers (``'model.layers.{layer}.'``). A path
    into sub-layer j of a `LayerPeriod` of ``period`` layers (``('sublayers', j, ...)``)
    names layer ``g·period + j``. ``layer_tensor`` (a family's,
    `tev_jax.models.registry.Family.layer_tensor`) names what it knows first.
    """
    if rest[0] == "sublayers":
        prefix = prefix.replace(LAYER_FIELD, LAYER_FIELD[:-1] + f":{period}+{rest[1]}}}")
        rest = rest[2:]
    named = None if layer_tensor is None else layer_tensor(prefix, rest)
    if named is not None:
        return named
    if rest[-1] == "kernel":
        n_in = 2 if rest[-2] == "o_proj" else 1
        return prefix + ".".join(rest[:-1]) + ".weight", n_in
    return prefix + ".".join(str(r) for r in rest), -1 if rest[-1] == "bias" else 0


def hf_name(path: tuple, period: int = 1, layer_tensor=None) -> tuple[str, int]:
    """(HF tensor name, n_in) of a `Target` parameter path (see `NameOf`); ``period`` is
    the config's `ModelConfig.period` (the layers one stack step holds), ``layer_tensor``
    the family's names of layer parameters (`layer_param_name`)."""
    if path == ("embed_tokens",):
        return "model.embed_tokens.weight", 0
    if path == ("lm_head",):
        return "lm_head.weight", 1
    if path == ("norm", "weight"):
        return "model.norm.weight", 0
    if path[0] == "layers":
        return layer_param_name(f"model.layers.{LAYER_FIELD}.", path[1:], period,
                                layer_tensor)
    raise ValueError(f"no Hugging Face name for parameter {'/'.join(map(str, path))}")


def hf_name_of(config: ModelConfig, hf_config: Mapping[str, Any] | None = None) -> NameOf:
    """`hf_name` for a config's targets, with its family's names
    (`tev_jax.models.registry.Family`); ``hf_config``: the ``config.json`` of the
    checkpoint read, whose family may put the names under another prefix than
    ``model.`` (Gemma 4's unified checkpoint: ``model.language_model.``)."""
    fam = registry.family(config.model_type)
    name_of = functools.partial(hf_name, period=config.period,
                                layer_tensor=fam.layer_tensor)
    prefix = None if hf_config is None else fam.checkpoint_prefix(dict(hf_config))
    if prefix is None:
        return name_of

    def prefixed(path):
        name, n_in = name_of(path)
        return prefix + name[len("model."):] if name.startswith("model.") else name, n_in

    return prefixed


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


def tensor_names(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """(tensor name, our shape) of each stored tensor of a parameter: one, or one per
    layer (and expert) of a stacked parameter (`stack_axes` leading axes), row-major."""
    k = stack_axes(name)
    return [(stacked_name(name, index), tuple(shape[k:]))
            for index in itertools.product(*(range(n) for n in shape[:k]))]


def expected_shapes(abstract: nnx.Module, name_of: NameOf) -> dict[str, tuple[int, ...]]:
    """Tensor name -> PyTorch-layout shape of every `nnx.Param` of a (abstract) module."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        name, n_in = name_of(path)
        for tensor, shape in tensor_names(name, var.get_value().shape):
            out[tensor] = _hf_shape(shape, n_in)
    return out


def param_names(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> expected HF shape for a config (what a checkpoint must hold)."""
    return expected_shapes(nnx.eval_shape(lambda: Target(config, rngs=nnx.Rngs(0))),
                           hf_name_of(config))


# ---------------------------------------------------------------------- config io


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The dict in ``path/config.json`` (ValueError if absent or malformed)."""
    f = Path(path) / "config.json"
    if not f.is_file():
        raise ValueError(f"{path}: no config.json")
    try:
        hf = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{f}: not valid JSON ({e})") from e
    if not isinstance(hf, dict):
        raise ValueError(f"{f}: expected a JSON object")
    return hf


def read_config(path: str | os.PathLike) -> ModelConfig:
    """`ModelConfig` from ``path/config.json`` (ValueError if absent or malformed)."""
    return ModelConfig.from_hf(read_hf_config(path))


def hf_dtype_name(dtype) -> str:
    """The ``torch_dtype`` a config.json records for parameters of ``dtype``."""
    name = jnp.dtype(dtype).name
    return name if name in ("bfloat16", "float16") else "float32"


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


# ------------------------------------------------------------------ safetensors io


def _read_file_header(file: Path) -> dict[str, TensorInfo]:
    """Tensor name -> `TensorInfo` of one safetensors file, offsets checked against its size.

    The format: an 8-byte little-endian header length n, n bytes of JSON
    ``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": ...}``, then
    the data; offsets are relative to the data's start.
    """
    size = file.stat().st_size
    if size < 8:
        raise ValueError(f"{size} bytes, too short for a header")
    with open(file, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        if 8 + n > size:
            raise ValueError(f"header of {n} bytes in a file of {size}")
        header = json.loads(fh.read(n))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    data_size = size - 8 - n
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        if not 0 <= begin <= end <= data_size:
            raise ValueError(f"tensor {name}: bytes {begin}..{end} outside the "
                             f"{data_size} data bytes (truncated file?)")
        if dtype in _NUMPY_DTYPES:
            want = math.prod(shape) * np.dtype(_NUMPY_DTYPES[dtype]).itemsize
            if end - begin != want:
                raise ValueError(f"tensor {name}: {end - begin} bytes for {dtype}{list(shape)}")
        out[name] = TensorInfo(file.name, shape, dtype, 8 + n + begin)
    return out


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


def read_headers(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Tensor name -> `TensorInfo` over a checkpoint directory's files.

    Reads headers only. Raises ValueError for a corrupt or truncated file, an index
    naming a missing file or a tensor its file lacks, and a tensor stored twice.
    """
    path = Path(path)
    where: dict[str, TensorInfo] = {}
    for fname, indexed in _weight_files(path).items():
        fp = path / fname
        if not fp.is_file():
            raise ValueError(f"{path}: index names missing file {fname}")
        try:
            infos = _read_file_header(fp)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{fp}: corrupt or unreadable safetensors file ({e})") from e
        for k, info in infos.items():
            if k in where:
                raise ValueError(f"tensor {k} appears in both {where[k].file} and {fname}")
            where[k] = info
        for name in indexed:
            if name not in infos:
                raise ValueError(f"tensor {name}: listed in {INDEX_FILE} for {fname} "
                                 "but absent from that file")
    return where


def weights_fingerprint(path: str | os.PathLike, sample_bytes: int = 1 << 16) -> str:
    """16 hex digits identifying a checkpoint directory's model, in milliseconds for
    any size: the SHA-256 of its config.json, every weight file's name, size and
    header, and the first and last ``sample_bytes`` of each file's data (so two
    trainings of one architecture differ). Training refuses rollouts made by another
    target with it.

    Raises:
      ValueError: the directory has no weights (see `read_headers`).
    """
    path = Path(path)
    digest = hashlib.sha256()
    config = path / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"")
    for fname in sorted(_weight_files(path)):
        fp = path / fname
        size = fp.stat().st_size
        digest.update(f"{fname}:{size}".encode())
        with open(fp, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            digest.update(fh.read(min(n, size)))
            digest.update(fh.read(sample_bytes))
            fh.seek(max(8 + n, size - sample_bytes))
            digest.update(fh.read(sample_bytes))
    return digest.hexdigest()[:16]


def tensor_view(path: str | os.PathLike, info: TensorInfo) -> np.ndarray:
    """A read-only memory-mapped host view of one tensor (no data read until used)."""
    dtype = np.dtype(_NUMPY_DTYPES[info.dtype]).newbyteorder("<")
    if math.prod(info.shape) == 0:
        return np.zeros(info.shape, dtype)
    return np.memmap(Path(path) / info.file, dtype=dtype, mode="r", offset=info.offset,
                     shape=info.shape)


def check_tensors(expected: Mapping[str, tuple[int, ...]], where: Mapping[str, TensorInfo],
                  *, skip=(), what: str = "checkpoint") -> None:
    """Raises ValueError on missing / extra / misshapen / non-float tensors.

    Args:
      expected: tensor name -> shape (`expected_shapes`).
      where: what the files hold (`read_headers`).
      skip: names that may be present without being expected (besides
        `IGNORED_SUFFIXES`).
      what: how the messages name the checkpoint.
    """
    missing = sorted(set(expected) - set(where))
    if missing:
        raise ValueError(f"{what} is missing tensor(s): {', '.join(missing[:10])}"
                         + (f" (+{len(missing) - 10} more)" if len(missing) > 10 else ""))
    extra = sorted(n for n in where if n not in expected and n not in skip
                   and not n.endswith(IGNORED_SUFFIXES))
    if extra:
        raise ValueError(f"{what} has unexpected tensor(s): {', '.join(extra[:10])}"
                         + (f" (+{len(extra) - 10} more)" if len(extra) > 10 else ""))
    for name, shape in expected.items():
        got = tuple(where[name].shape)
        if got != tuple(shape):
            raise ValueError(f"tensor {name}: shape {got}, expected {tuple(shape)}")
        if where[name].dtype not in FLOAT_DTYPES:
            raise ValueError(f"tensor {name}: dtype {where[name].dtype}, expected a float type")


def load_params(path: str | os.PathLike, abstract: nnx.Module, name_of: NameOf,
                where: Mapping[str, TensorInfo], *, mesh: Mesh | None = None,
                rules: shd.Rules | None = None):
    """Fills an abstract module (``nnx.eval_shape``) with a checked checkpoint's tensors.

    Each device's block of a parameter is read from the tensors' memory maps, converted
    to our layout and the parameter's dtype, and placed with
    ``jax.make_array_from_callback`` into its final sharding (by logical axes on
    ``mesh``, else the default device); a stacked parameter's layers (and experts) are
    stored as separate tensors, of which each device reads those in its block.

    Returns:
      The module, concrete.
    Raises:
      ValueError: a file's data cannot be read.
    """
    path = Path(path)
    graphdef, abs_state = nnx.split(abstract)
    if mesh is None:
        dev = SingleDeviceSharding(jax.devices()[0])
        sharding_of = None
    else:
        sharding_of = {p: v.get_value() for p, v in
                       nnx.to_flat_state(shd.state_shardings(abs_state, mesh, rules))}
    leaves = []
    for p, var in nnx.to_flat_state(abs_state):
        name, n_in = name_of(p)
        aval = var.get_value()

        def block(tensor, shape, idx, dtype=aval.dtype, n_in=n_in):
            # This device's block only (a view of the map until the cast): no full host
            # copy of a stacked parameter exists.
            try:
                w = _to_ours(tensor_view(path, where[tensor]), shape, n_in)[idx]
                return w.astype(dtype, order="C")
            except (OSError, ValueError) as e:
                raise ValueError(f"{path / where[tensor].file}: cannot read tensor data "
                                 f"({e})") from e

        def read(idx, name=name, shape=aval.shape, k=stack_axes(name)):
            if not k:
                return block(name, shape, idx)
            ranges = [range(*idx[a].indices(shape[a])) for a in range(k)]
            blocks = [block(stacked_name(name, index), shape[k:], idx[k:])
                      for index in itertools.product(*ranges)]
            return np.stack(blocks).reshape(tuple(map(len, ranges)) + blocks[0].shape)

        arr = jax.make_array_from_callback(
            aval.shape, dev if sharding_of is None else sharding_of[p], read)
        leaves.append((p, var.replace(arr)))
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def write_atomically(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Runs ``write(tmp)`` on a fresh temporary sibling of ``path``, then renames it to
    ``path``.

    A failed ``write`` leaves nothing behind; an existing ``path`` is replaced only
    after the new directory is complete.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path}: exists and is not a directory")
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))
    try:
        write(tmp)
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


def save_params(module: nnx.Module, path: str | os.PathLike, hf_config: Mapping[str, Any],
                name_of: NameOf, *, tokenizer=None, max_shard_bytes: int = 4 << 30,
                dtype=None) -> None:
    """Writes ``module``'s parameters as a safetensors checkpoint directory, atomically.

    Tensors are fetched and converted to PyTorch layout one shard at a time; above
    ``max_shard_bytes`` they are split into ``model-0000k-of-0000n.safetensors`` files
    with a ``model.safetensors.index.json``. bfloat16 parameters are written as BF16.

    Args:
      module: the model.
      path: output directory (see `write_atomically`).
      hf_config: written as config.json.
      name_of: parameter path -> (tensor name, n_in).
      tokenizer: optional `tokenizers.Tokenizer`, written as tokenizer.json.
      max_shard_bytes: the largest file size before splitting.
      dtype: if given, every tensor is cast to it on the host before writing
        (round-to-nearest-even for bfloat16); default: each parameter's own dtype.
    """
    from safetensors.numpy import save_file

    out_dtype = None if dtype is None else np.dtype(jnp.dtype(dtype))
    shards: list[list] = [[]]
    size = 0
    for p, v in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        name, n_in = name_of(p)
        value = v.get_value()
        itemsize = (value.dtype if out_dtype is None else out_dtype).itemsize
        k = stack_axes(name)
        for index in itertools.product(*(range(n) for n in value.shape[:k])):
            nbytes = math.prod(value.shape[k:]) * itemsize
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            tensor = stacked_name(name, index)
            get = lambda value=value, index=index: value[index]  # noqa: E731
            shards[-1].append((tensor, n_in, get))
            size += nbytes

    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
        n = len(shards)
        weight_map = {}
        total = 0
        for k, shard in enumerate(shards):
            fname = SINGLE_FILE if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            tensors = {}
            for name, n_in, get in shard:
                w = np.asarray(jax.device_get(get()))
                tensors[name] = _to_hf(w if out_dtype is None else w.astype(out_dtype), n_in)
                weight_map[name] = fname
                total += tensors[name].nbytes
            save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            del tensors
        if n > 1:
            (tmp / INDEX_FILE).write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        if tokenizer is not None:
            tokenizer.save(str(tmp / "tokenizer.json"))

    write_atomically(path, write)


# --------------------------------------------------------------------------- target


def load_target(path: str | os.PathLike, *, dtype=jnp.float32, mesh: Mesh | None = None,
                rules: shd.Rules | None = None, check_tokenizer: bool = True,
                attention_window: str = "native") -> Target:
    """Loads a local Hugging Face checkpoint directory into a `Target`.

    Args:
      path: directory with config.json and safetensors weights (any float dtype,
        bfloat16 included).
      dtype: parameter/activation dtype (float32 or bfloat16).
      mesh: if given, every parameter is placed with the sharding its logical axes ask
        for (`tev_jax.sharding`); otherwise on the default device.
      rules: logical -> mesh axis rules (default `tev_jax.sharding.DEFAULT_RULES`).
      check_tokenizer: if ``tokenizer.json`` exists, require its ids < vocab_size.
      attention_window: 'native' (sliding layers slide, as trained) or 'full' (every
        layer global, as the DFlash authors ran Gemma 4; `ModelConfig.attention_window`).
    Returns:
      The model (config at ``.config``).
    Raises:
      ValueError: malformed config, unsupported architecture, corrupt files, missing /
        extra / misshapen tensors, tokenizer-vocabulary mismatch. Nothing is returned
        half-loaded.
    """
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: not a directory")
    hf = read_hf_config(path)
    config = ModelConfig.from_hf(hf)
    if attention_window != "native":
        config = dataclasses.replace(config, attention_window=attention_window)
    if check_tokenizer and (path / "tokenizer.json").is_file():
        check_vocab(config, load_tokenizer(path))
    where = read_headers(path)
    abstract = nnx.eval_shape(lambda: Target(config, dtype=dtype, rngs=nnx.Rngs(0)))
    # Some tied checkpoints store the shared matrix twice.
    skip = ["lm_head.weight"] if config.tie_word_embeddings else []
    # e.g. the vision / audio parts of a multimodal checkpoint
    skip += registry.family_of_hf(hf).foreign_tensors(hf, list(where))
    name_of = hf_name_of(config, hf)
    check_tensors(expected_shapes(abstract, name_of), where, skip=tuple(skip))
    return load_params(path, abstract, name_of, where, mesh=mesh, rules=rules)


def save_target(model: Target, path: str | os.PathLike, *, tokenizer=None,
                max_shard_bytes: int = 4 << 30, dtype=None) -> None:
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
      dtype: the stored dtype (e.g. ``jnp.bfloat16`` to halve a float32 model's files;
        config.json's ``torch_dtype`` says it); default: the model's own dtype.
    """
    stored = model.dtype if dtype is None else dtype
    hf = model.config.to_hf(dtype=hf_dtype_name(stored))
    save_params(model, path, hf, hf_name_of(model.config), tokenizer=tokenizer,
                max_shard_bytes=max_shard_bytes, dtype=dtype)
