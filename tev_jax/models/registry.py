"""Target families as a registry (docs/design.md §14 and "Code style").

A family is a set of ``model_type`` values with one way to read and write their
``config.json``, to build their decoder layers and to name their checkpoint tensors.
Each family lives in its own file under `tev_jax.models.families` and registers itself
there with `register`; the core (`tev_jax.models.config`, `tev_jax.models.layers`,
`tev_jax.models.target`, `tev_jax.models.checkpoint_io`) looks a family up by
``model_type`` (`family`, `family_of_hf`) and never imports one. Importing
`tev_jax.models` registers every family shipped with the package.

Adding a family is one file: a `Family` and a `register` call, plus its tests::

    register(Family(
        name="mine", model_types=("mine",), read_config=..., write_config=...,
        decoder_layer=...))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


def _no_foreign_tensors(hf: dict[str, Any], names) -> list[str]:
    return []


@dataclasses.dataclass(frozen=True)
class Family:
    """What the core needs of a target family.

    Attributes:
      name: a label for messages.
      model_types: the `ModelConfig.model_type` values it builds (each in one family
        only).
      read_config: ``read_config(hf: dict) -> ModelConfig`` from a ``config.json``
        dict; raises ValueError naming what it does not support.
      write_config: ``write_config(config, dtype: str) -> dict``, a ``config.json``
        that transformers reads back (``dtype`` is its ``torch_dtype``).
      decoder_layer: ``decoder_layer(config, spec: LayerSpec, *, dtype, rngs, sub) ->
        DecoderLayer``: one layer of a `LayerSpec` (`tev_jax.models.layers`).
      layer_tensor: ``layer_tensor(prefix, rest) -> (name, n_in) | None``: the
        checkpoint name of a layer parameter the core's rule does not name
        (`tev_jax.models.checkpoint_io.layer_param_name`; ``rest`` is its path inside
        the layer), None for the rest.
      hf_model_types: further ``config.json`` ``model_type`` values it reads (e.g. a
        multimodal wrapper of the text model).
      checkpoint_prefix: ``checkpoint_prefix(hf: dict) -> str | None``: the name
        prefix that replaces ``model.`` in the checkpoint of that ``config.json``
        (None: the names as they are).
      foreign_tensors: ``foreign_tensors(hf, names) -> list[str]``: tensors of a
        checkpoint that belong to no part of the target (skipped when loading).
    """

    name: str
    model_types: tuple[str, ...]
    read_config: Callable[..., Any]
    write_config: Callable[..., dict[str, Any]]
    decoder_layer: Callable[..., Any]
    layer_tensor: Callable[[str, tuple], tuple[str, int] | None] = lambda prefix, rest: None
    hf_model_types: tuple[str, ...] = ()
    checkpoint_prefix: Callable[[dict[str, Any]], str | None] = lambda hf: None
    foreign_tensors: Callable[..., list[str]] = _no_foreign_tensors


_FAMILIES: dict[str, Family] = {}   # model_type (config's or config.json's) -> family


def register(fam: Family) -> Family:
    """Adds a family; returns it.

    Raises:
      ValueError: a model_type already registered to another family.
    """
    for t in fam.model_types + fam.hf_model_types:
        other = _FAMILIES.get(t)
        if other is not None and other.name != fam.name:
            raise ValueError(f"model_type {t!r} is already registered to family "
                             f"{other.name!r}")
    for t in fam.model_types + fam.hf_model_types:
        _FAMILIES[t] = fam
    return fam


def model_types() -> tuple[str, ...]:
    """Every `ModelConfig.model_type` a registered family builds, in registration order."""
    return tuple(t for t, f in _FAMILIES.items() if t in f.model_types)


def _unsupported(model_type) -> ValueError:
    return ValueError(f"unsupported model_type {model_type!r}; supported: "
                      f"{', '.join(model_types()) or 'none (no family registered)'}")


def family(model_type: str) -> Family:
    """The family building ``model_type`` (a `ModelConfig.model_type`).

    Raises:
      ValueError: no registered family builds it (the message lists those that do).
    """
    fam = _FAMILIES.get(model_type)
    if fam is None or model_type not in fam.model_types:
        raise _unsupported(model_type)
    return fam


def family_of_hf(hf: dict[str, Any]) -> Family:
    """The family reading a ``config.json`` dict (by its ``model_type``).

    Raises:
      ValueError: no registered family reads it.
    """
    fam = _FAMILIES.get(hf.get("model_type"))
    if fam is None:
        raise _unsupported(hf.get("model_type"))
    return fam
