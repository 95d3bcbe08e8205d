"""The automatic tree budget: a DDTree budget per batch size, read from a tuning file.

`tev_jax.costs.tune` measures τ(b) and round costs and writes the tuning file (``tev-jax tune
--json FILE``); `AutoBudget` is its table in the hashable form a `DecodeConfig` can hold
(``DecodeConfig(budget='auto', tuning=FILE)``), and `resolve_budget` turns
it into a fixed budget (or plain AR) for the batch at hand, after checking that the models
are the ones it was tuned for (`model_fingerprint`, `check_tuned_for`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tev_jax.drafters import as_drafter


def read_tuning(path) -> dict:
    """The JSON object of a tuning file; a ValueError naming the file otherwise."""
    try:
        tuning = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else e
        raise ValueError(f"cannot read the tuning file {path}: {why}") from None
    if isinstance(tuning, dict):
        return tuning
    raise ValueError(f"the tuning file {path} must hold a JSON object")


@dataclasses.dataclass(frozen=True)
class AutoBudget:
    """The DDTree budget per batch size, from a tuning (`tev_jax.costs.tune`).

    ``DecodeConfig(budget=AutoBudget(...))`` (or ``budget='auto', tuning=FILE``) decodes
    each batch with the budget its tuning found best for that batch size, or with plain
    AR where nothing beat it (budget 0). It is resolved to an int before an engine is
    built (`resolve_budget`), which also checks that the models are the
    ones it was tuned for. Hashable, like the config that holds it.

    Attributes:
      table: ``((B, budget), ...)`` sorted by B; budget 0 means plain AR.
      models: the fingerprint of the models it was tuned for, as sorted ``(key, value)``
        pairs (`model_fingerprint`); empty: not checked.
      source: where it came from (the tuning file), for messages.
    """

    table: tuple[tuple[int, int], ...]
    models: tuple[tuple[str, Any], ...] = ()
    source: str = ""

    def __post_init__(self):
        table = tuple(sorted((int(b), int(n)) for b, n in self.table))
        if not table:
            raise ValueError(f"the automatic budget of {self.source or 'a tuning'} has no "
                             "batch sizes")
        if any(b < 1 or n < 0 for b, n in table) or len({b for b, _ in table}) < len(table):
            raise ValueError(f"the automatic budget of {self.source or 'a tuning'} must map "
                             f"distinct batch sizes >= 1 to budgets >= 0, got {table}")
        object.__setattr__(self, "table", table)
        object.__setattr__(self, "models", tuple(sorted(dict(self.models).items())))

    @property
    def budgets(self) -> tuple[int, ...]:
        """The DDTree budgets of the table (AR, 0, left out), smallest first."""
        return tuple(sorted({n for _, n in self.table if n > 0}))

    def pick(self, batch_size: int) -> int:
        """The budget for ``batch_size`` rows (0: plain AR): that of the tabulated batch
        size nearest on a log scale (the smaller one on a tie)."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        dist = lambda entry: (abs(math.log2(entry[0] / batch_size)), entry[0])
        return min(self.table, key=dist)[1]

    @classmethod
    def from_tuning(cls, tuning: dict, source: str = "") -> AutoBudget:
        """The table of a tuning file's JSON (its ``best`` and ``model`` entries)."""
        where = source or "the tuning"
        try:
            table = tuple((int(b), int(v["budget"])) for b, v in tuning["best"].items())
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{where} is not a tuning file (`tev-jax tune --json`): its "
                             f"'best' entry must map batch sizes to {{'budget': int, ...}} "
                             f"({type(e).__name__}: {e})") from None
        models = tuning.get("model") or {}
        if not isinstance(models, dict):
            raise ValueError(f"{where}: 'model' must be an object, got {type(models).__name__}")
        return cls(table=table, models=tuple(models.items()), source=source)

    @classmethod
    def load(cls, path) -> AutoBudget:
        """`from_tuning` of a tuning file (``tev-jax tune --json FILE``)."""
        return cls.from_tuning(read_tuning(path), source=str(path))

    def as_dict(self) -> dict:
        """JSON form: ``{"auto": {"<B>": budget}, "source": path}``."""
        return {"auto": {str(b): n for b, n in self.table}, "source": self.source}


def model_fingerprint(target, drafter=None) -> dict:
    """What identifies a (target, drafter) pair to a tuning: ``{"vocab_size": V,
    "target": digest, "drafter": digest or None, "weights": digest or None}``.

    The architecture digests hash each model's type and its parameters' paths, shapes
    and dtypes; the weights digest hashes the first few values of every parameter (None
    for abstract models). Cheap: a few values per array leave the devices.
    """
    drafter = as_drafter(drafter)
    flat = {name: None if m is None else
            jax.tree_util.tree_flatten_with_path(nnx.state(m, nnx.Param))[0]
            for name, m in (("target", target), ("drafter", drafter))}

    def arch(name, model):
        if model is None:
            return None
        h = hashlib.sha256(type(model).__name__.encode())
        for path, x in flat[name]:
            h.update(f"{jax.tree_util.keystr(path)}:{tuple(x.shape)}:{x.dtype};".encode())
        return h.hexdigest()[:16]

    arrays = [x for leaves in flat.values() if leaves for _, x in leaves]
    weights = None
    if arrays and not any(isinstance(x, jax.ShapeDtypeStruct) for x in arrays):
        heads = np.asarray(jax.device_get(_weight_heads(arrays)), np.float32)
        weights = hashlib.sha256(heads.tobytes()).hexdigest()[:16]
    return {"vocab_size": int(target.config.vocab_size), "target": arch("target", target),
            "drafter": arch("drafter", drafter), "weights": weights}


@jax.jit
def _weight_heads(arrays):
    """The first (up to) 8 values of the first row of every array, as one float32
    vector: one program and one transfer, whatever the number of arrays."""
    heads = [x.reshape(-1)[:8] if x.ndim < 2 else x[(0,) * (x.ndim - 1)][:8]
             for x in arrays]
    return jnp.concatenate([h.astype(jnp.float32) for h in heads])


def check_tuned_for(auto: AutoBudget, target, drafter=None) -> None:
    """Raises ValueError (naming the tuning file and what differs) unless ``auto`` was
    tuned for these models: the vocabulary, the target's and the drafter's architecture
    and, where both sides have one, the weights digest (`model_fingerprint`)."""
    want = dict(auto.models)
    if not want:
        return
    have = model_fingerprint(target, drafter)
    where = auto.source or "the automatic budget"
    if want.get("vocab_size") != have["vocab_size"]:
        raise ValueError(f"{where} was tuned for a vocabulary of {want.get('vocab_size')} "
                         f"tokens, but this target has {have['vocab_size']}: rerun "
                         "`tev-jax tune` for this model")
    for key, what in (("target", "the target's architecture differs"),
                      ("drafter", "the drafter's architecture differs"),
                      ("weights", "the weights differ")):
        if key == "weights" and (want.get(key) is None or have[key] is None):
            continue
        if want.get(key) != have[key]:
            raise ValueError(f"{where} was tuned for other models ({what}: "
                             f"{want.get(key)} there, {have[key]} here): rerun "
                             "`tev-jax tune` for these models")


def resolve_budget(config, batch_size: int, target=None, drafter=None):
    """``config`` with an automatic budget (`tev_jax.budget.AutoBudget`) resolved for a
    batch of ``batch_size`` rows: a fixed DDTree budget, or ``builder='none'`` (plain
    AR) where the tuning found nothing faster. Other configs come back unchanged.

    Args:
      config: a `DecodeConfig`.
      batch_size: B, the rows decoded together.
      target, drafter: the models; when given, the tuning must have been made for them
        (`check_tuned_for`).
    Raises:
      ValueError: the tuning was made for other models or another vocabulary.
    """
    if not isinstance(getattr(config, "budget", None), AutoBudget):
        return config
    auto = config.budget
    if config.builder != "ddtree":  # the budget is not read
        return dataclasses.replace(config, budget=64, tuning=None)
    if target is not None:
        check_tuned_for(auto, target, drafter)
    budget = auto.pick(batch_size)
    if budget == 0:
        return dataclasses.replace(config, builder="none", budget=64, tuning=None)
    return dataclasses.replace(config, budget=budget, tuning=None)


__all__ = ["AutoBudget", "check_tuned_for", "model_fingerprint", "read_tuning",
           "resolve_budget"]
