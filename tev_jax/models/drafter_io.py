"""DFlash drafter checkpoints: `load_drafter`, `save_drafter`, `init_drafter`.

The public DFlash layout (what ``DFlashDraftModel.save_pretrained`` writes)::

    config.json          Qwen3 fields + block_size, num_target_layers,
                         dflash_config.{mask_token_id, target_layer_ids}
    model.safetensors    (or shards + model.safetensors.index.json)

Tensor names (PyTorch ``[out, in]`` weights, no embedding or lm_head)::

    fc.weight                       [D, len(taps) * D]
    hidden_norm.weight, norm.weight [D]
    layers.{i}.self_attn.{q,k,v,o}_proj.weight (+ .bias with attention_bias)
    layers.{i}.self_attn.{q,k}_norm.weight
    layers.{i}.mlp.{gate,up,down}_proj.weight
    layers.{i}.{input,post_attention}_layernorm.weight
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from tev_jax import sharding as shd
from tev_jax.models.checkpoint_io import (
    _FLOAT_DTYPES, _IGNORED_SUFFIXES, SINGLE_FILE, _hf_shape, _read_headers, _to_hf, _to_ours,
)
from tev_jax.models.config import ModelConfig
from tev_jax.models.drafter import Drafter, DrafterConfig, default_target_layer_ids
from tev_jax.models.layers import fast_init


_NUMPY_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
                 "BF16": ml_dtypes.bfloat16}


class _RawSafetensors:
    """Zero-copy host views of a safetensors file's tensors, bfloat16 included.

    (``safe_open(framework="numpy")`` cannot return bfloat16 tensors, the dtype of the
    published DFlash checkpoints.)
    """

    def __init__(self, file: Path):
        with open(file, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            self.header = json.loads(fh.read(n))
        self.data = np.memmap(file, dtype=np.uint8, mode="r", offset=8 + n)

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        start, end = info["data_offsets"]
        dtype = np.dtype(_NUMPY_DTYPES[info["dtype"]]).newbyteorder("<")
        return self.data[start:end].view(dtype).reshape(info["shape"])


def _hf_name(path: tuple) -> tuple[str, int]:
    """(DFlash tensor name, n_in) of a parameter path (n_in as in checkpoint_io)."""
    if path == ("fc", "kernel"):
        return "fc.weight", 1
    if path in (("norm", "weight"), ("hidden_norm", "weight")):
        return f"{path[0]}.weight", 0
    if path[0] == "layers":
        i, rest = path[1], path[2:]
        if rest[-1] == "kernel":
            n_in = 2 if rest[-2] == "o_proj" else 1
            return f"layers.{i}." + ".".join(rest[:-1]) + ".weight", n_in
        return f"layers.{i}." + ".".join(str(r) for r in rest), -1 if rest[-1] == "bias" else 0
    raise ValueError(f"no DFlash name for parameter {'/'.join(map(str, path))}")


def drafter_param_names(config: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """DFlash tensor name -> expected PyTorch shape for a drafter config."""
    abstract = nnx.eval_shape(lambda: Drafter(config, rngs=nnx.Rngs(0)))
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        name, n_in = _hf_name(path)
        out[name] = _hf_shape(var.get_value().shape, n_in)
    return out


def read_drafter_config(path: str | os.PathLike) -> DrafterConfig:
    """`DrafterConfig` from ``path/config.json`` (ValueError if absent or malformed)."""
    f = Path(path) / "config.json"
    if not f.is_file():
        raise ValueError(f"{path}: no config.json")
    try:
        hf = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{f}: not valid JSON ({e})") from e
    if not isinstance(hf, dict):
        raise ValueError(f"{f}: expected a JSON object")
    return DrafterConfig.from_hf(hf)


def _check_tensors(config: DrafterConfig, where) -> None:
    expected = drafter_param_names(config)
    names = {n for n in where if not n.endswith(_IGNORED_SUFFIXES)}
    missing = sorted(set(expected) - names)
    if missing:
        raise ValueError(f"drafter checkpoint is missing tensor(s): {', '.join(missing[:10])}"
                         + (f" (+{len(missing) - 10} more)" if len(missing) > 10 else ""))
    extra = sorted(names - set(expected))
    if extra:
        raise ValueError(f"drafter checkpoint has unexpected tensor(s): "
                         f"{', '.join(extra[:10])}"
                         + (f" (+{len(extra) - 10} more)" if len(extra) > 10 else ""))
    for name, shape in expected.items():
        got = tuple(where[name][1])
        if got != tuple(shape):
            raise ValueError(f"tensor {name}: shape {got}, expected {tuple(shape)}")
        if where[name][2] not in _FLOAT_DTYPES:
            raise ValueError(f"tensor {name}: dtype {where[name][2]}, expected a float type")


def load_drafter(path: str | os.PathLike, target, *, dtype=None, mesh: Mesh | None = None,
                 rules: shd.Rules | None = None) -> Drafter:
    """Loads a DFlash drafter checkpoint directory for ``target``.

    Args:
      path: directory with config.json and safetensors weights.
      target: the `Target` it will draft for (its config is checked).
      dtype: parameter dtype (default: the target's).
      mesh: if given, parameters are placed by their logical axes (`tev_jax.sharding`).
      rules: logical -> mesh axis rules.
    Returns:
      The `Drafter`.
    Raises:
      ValueError: malformed config, a drafter that does not fit the target (hidden
        size, vocabulary, tapped layers), or missing / extra / misshapen tensors.
    """
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: not a directory")
    config = read_drafter_config(path)
    config.check_target(target.config)
    where = _read_headers(path)
    _check_tensors(config, where)
    dtype = target.dtype if dtype is None else jnp.dtype(dtype)

    abstract = nnx.eval_shape(lambda: Drafter(config, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, abs_state = nnx.split(abstract)
    sharding_of = (None if mesh is None else
                   {p: v.get_value() for p, v in
                    nnx.to_flat_state(shd.state_shardings(abs_state, mesh, rules))})
    dev = SingleDeviceSharding(jax.devices()[0])
    by_file: dict[str, list] = {}
    for p, var in nnx.to_flat_state(abs_state):
        name, n_in = _hf_name(p)
        by_file.setdefault(where[name][0], []).append((p, var, name, n_in))
    leaves = []
    for fname, items in by_file.items():
        try:
            f = _RawSafetensors(path / fname)
            for p, var, name, n_in in items:
                aval = var.get_value()
                w = _to_ours(f.get(name), aval.shape, n_in).astype(aval.dtype)
                s = dev if sharding_of is None else sharding_of[p]
                arr = jax.make_array_from_callback(aval.shape, s, lambda idx, w=w: w[idx])
                leaves.append((p, var.replace(arr)))
            del f
        except Exception as e:
            raise ValueError(f"{path / fname}: cannot read tensor data ({e})") from e
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def save_drafter(drafter: Drafter, path: str | os.PathLike) -> None:
    """Writes ``drafter`` in the DFlash layout (config.json + model.safetensors).

    The directory is assembled in a temporary sibling and renamed into place, so a
    failed save never leaves a half-written ``path``.
    """
    from safetensors.numpy import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path}: exists and is not a directory")
    dtype_name = {"bfloat16": "bfloat16", "float16": "float16"}.get(
        jnp.dtype(drafter.dtype).name, "float32")
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))
    try:
        hf = drafter.config.to_hf(dtype=dtype_name)
        (tmp / "config.json").write_text(json.dumps(hf, indent=2))
        tensors = {}
        for p, v in nnx.to_flat_state(nnx.state(drafter, nnx.Param)):
            name, n_in = _hf_name(p)
            tensors[name] = _to_hf(np.asarray(jax.device_get(v.get_value())), n_in)
        save_file(tensors, str(tmp / SINGLE_FILE), metadata={"format": "pt"})
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


def drafter_config_for(target_config: ModelConfig, *, num_layers: int, block_size: int,
                       mask_token_id: int, target_layer_ids=None,
                       intermediate_size: int | None = None) -> DrafterConfig:
    """A drafter config shaped like the target's layers (as DFlash drafters are).

    Args:
      target_config: the target's `ModelConfig`.
      num_layers: drafter depth.
      block_size: H + 1.
      mask_token_id: MASK token id (a target token id).
      target_layer_ids: tapped target layers (default `default_target_layer_ids`).
      intermediate_size: MLP width (default the target's).
    """
    t = target_config
    model = ModelConfig(
        model_type="qwen3", vocab_size=t.vocab_size, hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size if intermediate_size is None
        else int(intermediate_size),
        num_layers=int(num_layers), num_heads=t.num_heads, num_kv_heads=t.num_kv_heads,
        head_dim=t.head_dim, rope_theta=t.rope_theta, rope_scaling=t.rope_scaling,
        rms_norm_eps=t.rms_norm_eps, tie_word_embeddings=False, qk_norm=True,
        attention_bias=False, max_position_embeddings=t.max_position_embeddings,
    )
    ids = (default_target_layer_ids(t.num_layers, int(num_layers)) if target_layer_ids is None
           else tuple(int(i) for i in target_layer_ids))
    config = DrafterConfig(model=model, block_size=int(block_size),
                           num_target_layers=t.num_layers, mask_token_id=int(mask_token_id),
                           target_layer_ids=ids)
    config.check_target(t)
    return config


def init_drafter(target, *, num_layers: int, block_size: int, mask_token_id: int,
                 key: jax.Array | int = 0, target_layer_ids=None,
                 intermediate_size: int | None = None, dtype=None,
                 mesh: Mesh | None = None, rules: shd.Rules | None = None) -> Drafter:
    """A randomly initialised drafter for ``target`` (training from scratch).

    Weights follow the Qwen3 initialisation (kernels normal(0, 0.02), unit norms); the
    layers copy the target's width, heads, head_dim, RoPE and epsilon. The values come
    from one jitted draw (`tev_jax.models.layers.fast_init`), born sharded on ``mesh``.

    Args:
      target: the `Target`.
      num_layers, block_size, mask_token_id, target_layer_ids, intermediate_size: see
        `drafter_config_for`.
      key: PRNG key or int seed.
      dtype: parameter dtype (default: the target's).
      mesh, rules: if given, parameters are placed by their logical axes.
    """
    config = drafter_config_for(target.config, num_layers=num_layers, block_size=block_size,
                                mask_token_id=mask_token_id, target_layer_ids=target_layer_ids,
                                intermediate_size=intermediate_size)
    if isinstance(key, int):
        key = jax.random.key(key)
    dtype = target.dtype if dtype is None else jnp.dtype(dtype)
    graphdef, init = _initializer(config, dtype, mesh, rules)
    return nnx.merge(graphdef, init(key))


@functools.lru_cache(maxsize=16)
def _initializer(config: DrafterConfig, dtype, mesh, rules):
    """(graphdef, jitted key -> state), cached so repeated inits compile once."""
    abstract = nnx.eval_shape(lambda: Drafter(config, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, abs_state = nnx.split(abstract)
    out = None if mesh is None else shd.state_shardings(abs_state, mesh, rules)
    return graphdef, jax.jit(lambda k: fast_init(abs_state, k), out_shardings=out)


__all__ = ["drafter_config_for", "drafter_param_names", "init_drafter", "load_drafter",
           "read_drafter_config", "save_drafter"]
