"""Named scopes that carry cost hints from the model code to the op table.

The plan's per-op table (`tev_jax.costs.op_costs`) reads the optimised HLO of a compiled
program. Two things it cannot see there are told to it by a ``jax.named_scope`` around
the code: a loop whose trip count depends on the data but has a bound (`bound_scope`),
and a kernel whose custom call carries no cost of its own (`kernel_scope`). The model
code and the kernels write these names; only the op table reads them (`BOUND`,
`KERNEL_COST`), so neither side imports the other.
"""

import re


def bound_scope(n: int) -> str:
    """The ``jax.named_scope`` name that tells the op table a loop of data-dependent trip
    count (a ``fori_loop`` with traced bounds) runs at most ``n`` times; wrap the loop in
    it: ``with jax.named_scope(bound_scope(n)): jax.lax.fori_loop(lo, hi, ...)``."""
    return f"trips_upto_{int(n)}"


def kernel_scope(flops: int, bytes_accessed: int) -> str:
    """The ``jax.named_scope`` name that gives the op table a kernel's own count where its
    custom call carries none (a Pallas Triton call drops ``pl.CostEstimate``): wrap the
    ``pallas_call`` in it. Its operands may be whole stacks of which it reads a few
    blocks."""
    return f"kernel_cost_{int(flops)}_{int(bytes_accessed)}"


# what the op table reads back from an op's metadata
KERNEL_COST = re.compile(r'op_name="[^"]*\bkernel_cost_(\d+)_(\d+)/')
BOUND = re.compile(r'op_name="[^"]*\btrips_upto_(\d+)/while"')


__all__ = ["BOUND", "KERNEL_COST", "bound_scope", "kernel_scope"]
