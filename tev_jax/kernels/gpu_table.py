"""Per-GPU tables of a kernel's block sizes, looked up by device kind.

Each kernel that chooses block sizes keeps a table ``{gpu name: its blocks}`` over
`GPUS`; `lookup` picks the entry whose name the device kind contains ('NVIDIA H200'
-> 'H200'), the local GPU's when no kind is given, and `DEFAULT_GPU`'s for a kind the
table lacks or a plan compiled ahead of time without a GPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import jax

GPUS = ("H100", "H200", "B200")
DEFAULT_GPU = "H100"
Blocks = TypeVar("Blocks")


def lookup(table: Mapping[str, Blocks], kind: str | None = None) -> Blocks:
    """The ``table`` entry of a GPU: ``kind`` (a device kind such as 'NVIDIA H200'), else
    the first local device's when it is a GPU, else `DEFAULT_GPU`'s."""
    if kind is None:
        device = jax.devices()[0]
        kind = device.device_kind if device.platform == "gpu" else DEFAULT_GPU
    for name, blocks in table.items():
        if name.lower() in kind.lower():
            return blocks
    return table[DEFAULT_GPU]


def pow2(n: int) -> int:
    """The least power of two >= ``n`` (1 for n <= 1): Triton's block shapes."""
    return 1 << max(int(n) - 1, 0).bit_length()
