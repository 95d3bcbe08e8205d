"""Loads a study's script, ``experiments/NAME/run.py``, as a module for the tests (the
studies are scripts, not a package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


def load(name: str):
    """The module of ``experiments/<name>/run.py``, executed once per call."""
    spec = importlib.util.spec_from_file_location(f"{name}_run", EXPERIMENTS / name / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
