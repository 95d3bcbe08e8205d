"""Kernel launches of a compiled GPU program, counted in its optimised HLO.

On a GPU a program's time is not only its bytes over the bandwidth: every kernel costs a
few microseconds to launch and to fill the machine, whatever it moves, and a decode
round is made of many small kernels (the H200 measurements of 2026-12-04: a round of
the bundled 4-layer pair costs 0.6-1.2 ms more than an AR step at every budget).
`launches` lists what the GPU runtime launches for one call of a program compiled by
the CUDA plugin (``compiled.as_text()``), read the way XLA's GPU runtime runs it:

- every fusion of a computation that runs (the entry, loop bodies, branches) is one
  kernel: XLA's Triton GEMM fusions, the loop / input / output fusions of everything
  else, the custom fusions that copy a slice;
- every custom call is one: our Pallas Triton kernels (``__gpu$xla.gpu.triton``),
  cuBLAS GEMMs, CUB sorts, the TopK kernel;
- every op left unfused is one: a copy, a sort, a scatter, a collective's start;
- a ``while`` runs its body once per trip. A loop whose trip count the compiler knows
  (``known_trip_count``, e.g. a scan over layers) runs it that many times with no
  condition on the device; a counted ``i < N`` loop (`tev_jax.costs.op_costs.trip_count`)
  evaluates its condition each trip; a loop of unknown trip count (the fused decode
  loop) is counted once, as one round, its condition included (marked ``in_loop``);
  a loop named with `tev_jax.kernels.scopes.bound_scope` is counted at its bound;
- a ``conditional`` runs its largest branch (and copies its predicate to the host);
- free ops (parameters, tuples, bitcasts, constants, the ``-done`` halves of async
  pairs) launch nothing.

This is a count of kernels, not of their cost: a launch of a 2 GB GEMM and of a
one-element add count the same. `tev_jax.costs.gpu_time` weighs them.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter, defaultdict

from tev_jax.costs import op_costs
from tev_jax.kernels import scopes

_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_SCOPE = re.compile(r'op_name="([^"]*)"')
_SYNC = frozenset({"while-condition", "conditional"})


@dataclasses.dataclass(frozen=True)
class Launch:
    """One op that launches a kernel, and how many times one call launches it.

    Attributes:
      name: the HLO instruction.
      kind: what runs (`kind_of`): 'pallas', 'triton gemm', 'cublas', 'sort', 'top-k',
        'collective', 'copy', 'while-condition', 'conditional', or 'fusion:<root op>'
        for XLA's own fusions (e.g. 'fusion:reduce', 'fusion:scatter').
      count: launches per call (or per round when ``in_loop``): the product of the trip
        counts of the loops around it.
      in_loop: inside a loop of unknown trip count (a decode round), counted per trip.
      scope: the ``jax.named_scope`` / transform path (``op_name`` metadata).
      source: ``file:line (function)`` of the innermost user frame, or ''.
      loops: the scopes of the loops around it, outermost first, each as its body's
        (``.../verify/while/body``): an op the compiler left without metadata still
        belongs to the loop it runs in.
    """

    name: str
    kind: str
    count: int
    in_loop: bool
    scope: str
    source: str
    loops: tuple[str, ...] = ()

    def stage(self, stages) -> str | None:
        """The first of ``stages`` that names a component of ``scope``, else None."""
        parts = set(self.scope.split("/"))
        return next((s for s in stages if s in parts), None)


def kind_of(module: op_costs.Module, instr: op_costs.Instr) -> str:
    """What a launching instruction runs (see `Launch.kind`)."""
    if instr.opcode == "custom-call":
        target = _TARGET.search(instr.attrs)
        target = target.group(1) if target else ""
        if "triton" in target:
            return "pallas"
        if target.startswith("__cublas"):
            return "cublas"
        if "Sort" in target or "sort" in target:
            return "sort"
        if "TopK" in target or "topk" in target.lower():
            return "top-k"
        return f"custom-call:{target}"
    if instr.opcode == "fusion":
        if "__triton_gemm" in instr.attrs or re.search(r'"kind":"__triton', instr.attrs):
            return "triton gemm"
        body = module.fused(instr)
        root = body[-1] if body else None
        while root is not None and root.opcode in ("bitcast", "tuple", "convert", "copy") \
                and root.operands and root.operands[0] in {i.name for i in body}:
            root = next(i for i in body if i.name == root.operands[0])
        return f"fusion:{root.opcode if root is not None else '?'}"
    if instr.opcode.startswith(("all-", "reduce-scatter", "collective", "send", "recv")):
        return "collective"
    return instr.opcode.removesuffix("-start")


def launches(text: str) -> list[Launch]:
    """Every launching op of the compiled GPU program whose HLO text is ``text`` (the
    counting rules are the module docstring's)."""
    module = op_costs.parse_module(text)
    out: list[Launch] = []

    def add(instr, kind, count, loops, around=()):
        scope = _SCOPE.search(instr.attrs)
        out.append(Launch(instr.name, kind, count, loops > 0,
                          scope.group(1) if scope else "", module.source(instr.attrs),
                          around))

    def walk(name: str, count: int, loops: int, seen: tuple[str, ...], around=()):
        if name in seen or name not in module.computations:
            return
        body = module.computations[name]
        defs = {i.name: i for i in body}
        for instr in body:
            if instr.opcode == "while":
                cond = op_costs.called(instr.attrs, "condition")
                n = op_costs.trip_count(module, instr, defs)
                bound = scopes.BOUND.search(instr.attrs) if n is None else None
                known = re.search(r'"known_trip_count"', instr.attrs) is not None
                if n is not None:
                    inner = (count * n, loops)
                elif bound is not None:
                    n, inner = int(bound.group(1)), (count * int(bound.group(1)), loops)
                else:
                    inner = (count, loops + 1)
                scope = _SCOPE.search(instr.attrs)
                body_of = around + ((scope.group(1) if scope else "") + "/body",)
                for c in op_costs.called(instr.attrs, "body"):
                    walk(c, *inner, seen + (name,), body_of)
                if not known:  # the condition runs on the device, its result goes to the host
                    trips = inner[0] + count if n is not None else count
                    for c in cond:
                        walk(c, trips, inner[1], seen + (name,), around)
                    add(instr, "while-condition", trips, inner[1], around)
                continue
            if instr.opcode == "conditional":
                branches = [c for key in ("branch_computations", "true_computation",
                                          "false_computation")
                            for c in op_costs.called(instr.attrs, key)]
                sizes = []
                for c in branches:
                    before = len(out)
                    walk(c, count, loops, seen + (name,), around)
                    sizes.append((sum(x.count for x in out[before:]), out[before:]))
                    del out[before:]
                if sizes:
                    out.extend(max(sizes, key=lambda s: s[0])[1])
                add(instr, "conditional", count, loops, around)
                continue
            if instr.opcode == "call":
                for c in op_costs.called(instr.attrs, "to_apply"):
                    walk(c, count, loops, seen + (name,), around)
                continue
            if (instr.opcode in op_costs.FREE or instr.opcode.endswith("-done")
                    or instr.opcode == "async-update"):
                continue
            add(instr, kind_of(module, instr), count, loops, around)

    walk(module.entry, 1, 0, ())
    return out


def total(items) -> int:
    """Launches of one call (per round for the ``in_loop`` ones) of `launches` ``items``."""
    return sum(x.count for x in items)


def summary(items, stages=(), layer_scopes=()) -> dict:
    """Launches of `launches` ``items`` in total, per stage ('other' for the rest), per
    kind, host synchronisations (loop conditions and branches evaluated on the device),
    and how many are inside the layer stack: the ops whose scope, or the body of a loop
    around them, contains one of ``layer_scopes`` (e.g. ``'verify/while/body'``: the
    target's scan over its layers). An op without a stage in its scope takes the stage
    of the loops around it.

    Returns:
      {'total', 'layers', 'other_than_layers', 'syncs': int; 'stages': {stage: int};
      'other_than_layers_by_stage': {stage: int}; 'kinds': {kind: int}}.
    """
    in_layers = lambda x: any(s in p for s in layer_scopes for p in (x.scope, *x.loops))
    stage_of = lambda x: (x.stage(stages) or next(
        (s for p in x.loops for s in stages if s in p.split("/")), None) or "other")
    per_stage, rest, kinds = defaultdict(int), defaultdict(int), Counter()
    for x in items:
        per_stage[stage_of(x)] += x.count
        kinds[x.kind] += x.count
        if not in_layers(x):
            rest[stage_of(x)] += x.count
    order = lambda d: {k: d[k] for k in (*stages, "other") if k in d}
    layers = sum(x.count for x in items if in_layers(x))
    return {"total": total(items), "layers": layers,
            "other_than_layers": total(items) - layers,
            "syncs": sum(x.count for x in items if x.kind in _SYNC),
            "stages": order(per_stage), "other_than_layers_by_stage": order(rest),
            "kinds": dict(kinds.most_common())}


def format_summary(s: dict) -> str:
    """One or two lines of a `summary` for people."""
    stages = ", ".join(f"{k} {v}" for k, v in s["other_than_layers_by_stage"].items())
    kinds = ", ".join(f"{k} {v}" for k, v in list(s["kinds"].items())[:6])
    return (f"{s['total']} kernel launches ({s['layers']} in the layer stack, "
            f"{s['other_than_layers']} outside it: {stages}; {s['syncs']} host syncs); "
            f"by kind: {kinds}")


__all__ = ["Launch", "format_summary", "kind_of", "launches", "summary", "total"]
