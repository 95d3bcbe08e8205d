"""Where a compiled program's bytes and FLOPs go: a per-op table (``tev-jax plan --ops N``).

``compiled.cost_analysis()`` gives one total per program. This module reads the
optimised HLO text of a compiled program (``compiled.as_text()``) and assigns bytes
accessed and FLOPs to every op that runs — each fusion, copy, custom call and collective
— with the source line and ``jax.named_scope`` path (e.g. the decode stage) that made
it, so that an excess over the floor of a program can be traced to the code.

Ops inside a ``while`` loop of unknown trip count (the decode rounds) are counted once
per iteration and marked ``in_loop``; the ones outside run once per call (prefill,
layouts the compiler hoisted out of the loop). A loop whose trip count is known (the
compiler's ``known_trip_count``, or a counted loop ``i = 0; i < N; i += 1`` such as the
scan over the layers) multiplies the ops of its body, which ``cost_analysis`` does not
do (it counts a loop body once). A loop whose trip count depends on the data but has a
bound, which its code names with the `tev_jax.kernels.scopes.bound_scope` ``jax.named_scope`` (the
attention's loop over the key blocks a query may see: at most the cache's blocks),
is counted at that bound and its ops marked ``bounded``: a step at a full cache.

Reads the HLO of the TPU and GPU compilers (and XLA:CPU's). On GPU, matrix products are
Triton fusions (their FLOPs are those of the ``dot`` inside) or cuBLAS custom calls
(``__cublas$gemm``: FLOPs from the call's dimension numbers). A Pallas kernel counts
what its own cost estimate says (it may take a whole stack of weights and read a few
blocks).

The per-op figures follow XLA's own cost model, simplified: an op reads its operands and
writes its output, except that a fusion operand which is only sliced inside the fusion
counts as the slices read, and an in-place ``dynamic-update-slice`` (or ``scatter``)
counts the update, not the whole buffer. FLOPs are 2·M·N·K per dot (or convolution) plus
one per output element of other arithmetic. ``hbm_bytes`` leaves out arrays the TPU
compiler placed in on-chip memory (``S(1)`` in their layout): the compiler's "bytes
accessed" counts them, the HBM roofline should not.

Checked against the compiler's totals (``cost_analysis``) on TPU programs: the FLOPs agree
within 0.4 % on Qwen3-8B rounds (v5e:2x4, full depth) and within 3 % on a small model;
the bytes, a simpler model than XLA's (which weighs some fusion operands by how often they
are read), come to 75-86 % of the compiler's count at full size and never exceed it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from pathlib import Path

from tev_jax.kernels import scopes

DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
               "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
               "f64": 8, "c64": 8, "c128": 16, "token": 0}
_ARRAY = re.compile(
    r"\b(pred|token|bf16|c64|c128|f8\w*?|[suf]\d+)\[([0-9,]*)\](\{[^{}]*(?:\([^)]*\)[^{}]*)*\})?")
_HEADER = re.compile(r"^(ENTRY\s+)?%(\S+)\s+\(.*\)\s+->\s+.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s+=\s+")

FREE = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional",
    "call", "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency",
    "domain", "copy-done", "all-reduce-done", "all-gather-done", "collective-permute-done",
    "async-done", "async-update", "send-done", "recv-done", "get-dimension-size"})
"""Ops that move no data themselves (their bodies, if any, are counted on their own)."""

FREE_CALLS = frozenset({"ConcatBitcast"})
"""Custom calls that only reinterpret buffers (the TPU compiler joins prefetched slices of
a weight with ``ConcatBitcast``)."""

_KERNEL_ESTIMATE = re.compile(r'"cost_estimate":\{"flops":"(\d+)","transcendentals":"\d+",'
                              r'"bytes_accessed":"(\d+)"')
"""A Pallas kernel's own count (``pl.CostEstimate``) in its custom call's backend
config: its operands may be whole stacks of which it reads a few blocks."""

SLICING = frozenset({"dynamic-slice", "slice", "gather"})
NO_FLOPS = frozenset({
    "broadcast", "reshape", "transpose", "copy", "slice", "dynamic-slice", "dynamic-update-slice",
    "concatenate", "pad", "gather", "scatter", "iota", "reverse", "convert",
    "bitcast-convert", "select", "tuple-select", "sort", "custom-call"})
"""Data movement (and sorts, custom calls) to which XLA assigns no arithmetic FLOPs
(beside the `FREE` ops)."""


@dataclasses.dataclass(frozen=True)
class Instr:
    """One HLO instruction as printed: name, output type text, opcode, operand names, the
    text between the operand brackets and the attribute text after them."""

    name: str
    type: str
    opcode: str
    operands: tuple[str, ...]
    args: str
    attrs: str


@dataclasses.dataclass(frozen=True)
class Op:
    """An op that runs, with what one execution of its program costs.

    Attributes:
      name, opcode: the HLO instruction; ``kind`` is the fusion kind (kLoop, kOutput,
        kCustom...) or the opcode.
      shape: its output type, as printed (layouts dropped).
      bytes: bytes read and written per execution, times ``count`` (the compiler's way:
        every memory space).
      hbm_bytes: the part of ``bytes`` in high-bandwidth memory (arrays whose layout puts
        them in on-chip memory, ``S(1)``, left out): the traffic the roofline is about.
      flops: floating-point operations, times ``count``.
      count: executions per call (or per round when ``in_loop``): the product of the
        known trip counts of the loops around it.
      in_loop: inside a loop of unknown trip count (a decode round), counted per iteration.
      inner: inside a second loop of unknown trip count and no `tev_jax.kernels.scopes.bound_scope` within
        that one: counted once per round although it may run several times.
      bounded: inside a loop counted at its bound (`tev_jax.kernels.scopes.bound_scope`, e.g. the attention's
        loop over key blocks): ``count`` is the most it runs (a full cache).
      scope: the ``jax.named_scope`` / transform path (``op_name`` metadata).
      source: ``file:line (function)`` of the innermost user frame, or ''.
    """

    name: str
    opcode: str
    kind: str
    shape: str
    bytes: float
    hbm_bytes: float
    flops: float
    count: int
    in_loop: bool
    inner: bool
    scope: str
    source: str
    bounded: bool = False

    def stage(self, stages) -> str | None:
        """The first of ``stages`` that names a component of ``scope``, else None."""
        parts = set(self.scope.split("/"))
        return next((s for s in stages if s in parts), None)


def array_bytes(type_text: str, hbm_only: bool = False) -> float:
    """Bytes of every array in an HLO type (a tuple sums its elements); with
    ``hbm_only``, only the arrays in the default memory space (an ``S(n)`` in the layout
    puts a TPU array in on-chip memory instead)."""
    return sum(DTYPE_BYTES.get(dt, DTYPE_BYTES.get(dt[:2], 1)) * math.prod(
        int(d) for d in shape.split(",") if d)
        for dt, shape, layout in _ARRAY.findall(type_text)
        if not (hbm_only and re.search(r"S\([1-9]\d*\)", layout)))


def elements(type_text: str) -> int:
    """Elements of the first array in an HLO type (0 for none)."""
    m = _ARRAY.search(type_text)
    return 0 if m is None else math.prod(int(d) for d in m.group(2).split(",") if d)


def dims(type_text: str) -> list[int]:
    """Dimensions of the first array in an HLO type ([] for none)."""
    m = _ARRAY.search(type_text)
    return [] if m is None else [int(d) for d in m.group(2).split(",") if d]


def tuple_elements(type_text: str) -> list[str]:
    """The top-level elements of a tuple type ``(a, (b, c), d)`` -> ['a', '(b, c)', 'd']."""
    inner = type_text.strip()[1:_balanced(type_text.strip(), 0) - 1]
    parts, depth, start = [], 0, 0
    for i, c in enumerate(inner):
        depth += c in "([{"
        depth -= c in ")]}"
        if c == "," and depth == 0:
            parts.append(inner[start:i].strip())
            start = i + 1
    parts.append(inner[start:].strip())
    return [re.sub(r"^/\*[^*]*\*/", "", x) for x in parts]


def _balanced(s: str, i: int) -> int:
    """Index just past the bracket group that opens at ``s[i]``."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for j in range(i, len(s)):
        c = s[j]
        if c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return j + 1
    raise ValueError(f"unbalanced brackets in HLO line: {s[:120]}...")


def parse_instr(line: str) -> Instr | None:
    """An `Instr` from one instruction line, None for other lines."""
    m = _INSTR.match(line)
    if m is None:
        return None
    i = m.end()
    if line[i] == "(":  # tuple type
        j = _balanced(line, i)
    else:
        j = line.index(" ", i)
    type_text = line[i:j]
    k = line.index("(", j)
    opcode = line[j:k].strip()
    end = _balanced(line, k)
    args = line[k + 1:end - 1]
    operands = tuple(re.findall(r"%([^\s,()]+)", args))
    return Instr(m.group(1), type_text, opcode, operands, args, line[end:])


@dataclasses.dataclass
class Module:
    """A parsed HLO module: computations (name -> instructions), the entry's name and the
    source locations of its stack frames."""

    computations: dict[str, list[Instr]]
    entry: str
    frames: dict[int, tuple[str, int, str]]  # id -> (file, line, function)

    def fused(self, instr: Instr) -> list[Instr]:
        """The instructions of the computation a fusion calls ([] for none)."""
        names = called(instr.attrs, "calls")
        return self.computations.get(names[0], []) if names else []

    def source(self, attrs: str) -> str:
        """``file:line (function)`` of the op's innermost frame ('' without one)."""
        m = re.search(r"stack_frame_id=(\d+)", attrs)
        if m is not None and int(m.group(1)) in self.frames:
            file, line, fn = self.frames[int(m.group(1))]
            return f"{_short(file)}:{line} ({fn})"
        m = re.search(r'source_file="([^"]+)" source_line=(\d+)', attrs)
        return "" if m is None else f"{_short(m.group(1))}:{m.group(2)}"


def _short(path: str) -> str:
    parts = Path(path).parts
    for root in ("tev_jax", "experiments", "tests"):
        if root in parts:
            return "/".join(parts[parts.index(root):])
    return Path(path).name


def _table(text: str, title: str) -> dict[int, str]:
    m = re.search(rf"^{title}\n((?:\d+ .*\n)+)", text, re.MULTILINE)
    if m is None:
        return {}
    return {int(k): v for k, v in re.findall(r"^(\d+) (.*)$", m.group(1), re.MULTILINE)}


def parse_module(text: str) -> Module:
    """Parses the text of ``compiled.as_text()``.

    Raises:
      ValueError: no ENTRY computation (not an HLO module's text).
    """
    computations: dict[str, list[Instr]] = {}
    entry, current = None, None
    for line in text.splitlines():
        h = _HEADER.match(line)
        if h is not None:
            current = h.group(2)
            computations[current] = []
            if h.group(1):
                entry = current
            continue
        if current is not None:
            if line.startswith("}"):
                current = None
                continue
            instr = parse_instr(line)
            if instr is not None:
                computations[current].append(instr)
    if entry is None:
        raise ValueError("no ENTRY computation: not the text of a compiled HLO module")
    names = {k: v.strip('"') for k, v in _table(text, "FileNames").items()}
    funcs = {k: v.strip('"') for k, v in _table(text, "FunctionNames").items()}
    locs = {}
    for k, v in _table(text, "FileLocations").items():
        f = dict(re.findall(r"(\w+)=(\d+)", v))
        locs[k] = (names.get(int(f["file_name_id"]), "?"),
                   int(f["line"]), funcs.get(int(f["function_name_id"]), "?"))
    frames = {}
    for k, v in _table(text, "StackFrames").items():
        f = dict(re.findall(r"(\w+)=(\d+)", v))
        frames[k] = locs.get(int(f["file_location_id"]), ("?", 0, "?"))
    return Module(computations, entry, frames)


def trip_count(module: Module, loop: Instr, defs: dict[str, Instr]) -> int | None:
    """The trip count of a ``while``: the compiler's ``known_trip_count``, else that of a
    counted loop (a ``lax.scan`` / ``fori_loop``): the condition is ``i < N`` on a tuple
    element that starts at the constant 0 (``defs``: the enclosing computation's
    instructions by name) and that the body adds the constant 1 to. None otherwise."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', loop.attrs)
    if m is not None:
        return int(m.group(1))
    cond = module.computations.get(next(iter(called(loop.attrs, "condition")), ""), [])
    body = module.computations.get(next(iter(called(loop.attrs, "body")), ""), [])
    if not cond or not body or not loop.operands:
        return None
    c, b = ({i.name: i for i in comp} for comp in (cond, body))

    def view(name, where):
        """(instruction, its operands' names) through copies, bitcasts and a fusion that
        wraps a single op (XLA:CPU wraps compares and adds)."""
        i = where.get(name)
        while i is not None and i.opcode in ("copy", "bitcast") and len(i.operands) == 1:
            i = where.get(i.operands[0])
        if i is not None and i.opcode == "fusion":
            inner = module.fused(i)
            params = {p.name: int(p.args) for p in inner if p.opcode == "parameter"}
            root = inner[-1] if inner else None
            if root is not None and all(o in params for o in root.operands):
                return root, [i.operands[params[o]] for o in root.operands]
        return i, [] if i is None else list(i.operands)

    def index(name, where):
        i, _ = view(name, where)
        return (int(re.search(r"index=(\d+)", i.attrs).group(1))
                if i is not None and i.opcode == "get-tuple-element" else None)

    def constant(name, where):
        i, _ = view(name, where)
        return (int(i.args) if i is not None and i.opcode == "constant"
                and re.fullmatch(r"-?\d+", i.args) else None)

    root, args = view(cond[-1].name, c)
    if root.opcode != "compare" or "direction=LT" not in root.attrs or len(args) != 2:
        return None
    k, n = index(args[0], c), constant(args[1], c)
    init = defs.get(loop.operands[0])
    if k is None or n is None or init is None or init.opcode != "tuple":
        return None
    if constant(init.operands[k], defs) != 0 or body[-1].opcode != "tuple":
        return None
    step, terms = view(body[-1].operands[k], b)
    counted = (step is not None and step.opcode == "add"
               and {index(t, b) for t in terms} == {k, None}
               and {constant(t, b) for t in terms} == {1, None})
    return n if counted else None


def called(attrs: str, key: str) -> list[str]:
    """The computations an instruction's attribute ``key`` names (``calls``, ``body``,
    ``branch_computations``...), [] for none."""
    m = re.search(rf"\b{key}=\{{([^}}]*)\}}", attrs)
    if m is not None:
        return re.findall(r"%([^\s,]+)", m.group(1))
    m = re.search(rf"\b{key}=%([^\s,]+)", attrs)
    return [] if m is None else [m.group(1)]


def _updated_in_place(body: dict[str, Instr], root: Instr) -> dict[str, str]:
    """Fusion parameters that a root ``dynamic-update-slice`` or ``scatter`` writes in
    place -> the type of the update (what moves instead of the whole buffer)."""
    roots = ([body[o] for o in root.operands if o in body] if root.opcode == "tuple"
             else [root])
    update = {"dynamic-update-slice": 1, "scatter": 2}
    return {r.operands[0]: body[r.operands[update[r.opcode]]].type
            if r.operands[update[r.opcode]] in body else ""
            for r in roots
            if r.opcode in update and r.operands[0] in body
            and body[r.operands[0]].opcode == "parameter"}


def _flops(instr: Instr, shapes: dict[str, str]) -> float:
    """Arithmetic of one (unfused) instruction: 2 per multiply-add of a dot or a
    convolution (TPU programs express matrix products as convolutions), the input
    elements of a reduce, one per output element of other arithmetic."""
    if instr.opcode == "dot":
        lhs = dims(shapes.get(instr.operands[0], ""))
        m = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", instr.attrs)
        k = math.prod(lhs[int(d)] for d in m.group(1).split(",") if d) if m and lhs else 1
        return 2.0 * elements(instr.type) * k
    if instr.opcode == "convolution":
        return 2.0 * elements(instr.type) * _taps(instr, shapes)
    if instr.opcode == "custom-call" and re.search(r'custom_call_target="__cublas', instr.attrs):
        return _gemm_flops(instr, shapes)
    if instr.opcode in ("reduce", "reduce-window"):
        return float(sum(elements(shapes.get(o, "")) for o in instr.operands[:1]))
    if (instr.opcode in NO_FLOPS or instr.opcode in FREE
            or instr.opcode.endswith(("-start", "-done"))
            or instr.opcode.startswith(("all-", "reduce-scatter", "collective"))):
        return 0.0
    return float(elements(instr.type))


def _gemm_flops(call: Instr, shapes: dict[str, str]) -> float:
    """2 x output elements x contracted size of a cuBLAS GEMM custom call (its
    ``dot_dimension_numbers`` in the backend config; the output is its first array)."""
    m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', call.attrs)
    lhs = dims(shapes.get(call.operands[0], "")) if call.operands else []
    k = (math.prod(lhs[int(d)] for d in re.findall(r"\d+", m.group(1)))
         if m is not None and lhs else 1)
    return 2.0 * elements(call.type) * k


def _fused_flops(module: Module, fusion: Instr) -> float:
    """FLOPs of a fusion's computation, nested fusions included."""
    body = module.fused(fusion)
    shapes = {i.name: i.type for i in body}
    return sum(_fused_flops(module, i) if i.opcode == "fusion" else _flops(i, shapes)
               for i in body)


def _taps(conv: Instr, shapes: dict[str, str]) -> int:
    """Multiply-adds per output element of a convolution: the kernel's input features
    times, per spatial dimension, the window taps that can meet real input (the TPU
    compiler writes a batched matrix product as a convolution whose window slides over a
    padded length-1 dimension: one real tap, not the window's size)."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->", conv.attrs)
    lhs = dims(shapes.get(conv.operands[0], ""))
    kernel = dims(shapes.get(conv.operands[1], ""))
    if labels is None or len(labels.group(1)) != len(lhs) or len(labels.group(2)) != len(kernel):
        return math.prod(kernel[:-1]) if kernel else 1
    lhs_labels, kernel_labels = labels.groups()
    window = re.search(r"window=\{([^}]*)\}", conv.attrs)
    field = lambda key, n: ([int(x) for x in re.search(rf"{key}=([0-9x]+)", window.group(1))
                             .group(1).split("x")] if window and f"{key}=" in window.group(1)
                            else [1] * n)
    spatial = sorted(c for c in lhs_labels if c.isdigit())
    sizes, dilation = field("size", len(spatial)), field("lhs_dilate", len(spatial))
    taps = kernel[kernel_labels.index("i")] if "i" in kernel_labels else 1
    for k, c in enumerate(spatial):
        n = lhs[lhs_labels.index(c)]
        taps *= min(sizes[k], -(-sizes[k] // dilation[k]), n)
    return taps


def _fusion_bytes(module: Module, instr: Instr, shapes: dict[str, str], hbm: bool) -> float:
    """Bytes of one fusion: its output, and what it reads of each operand (the slices of
    an operand it only slices, the update of a buffer it updates in place)."""
    body_list = module.fused(instr)
    if not body_list:
        return _plain_bytes(instr, shapes, hbm)
    body = {i.name: i for i in body_list}
    in_place = _updated_in_place(body, body_list[-1])
    moved = 0.0
    for i in body_list:
        if i.opcode != "parameter" or int(i.args) >= len(instr.operands):
            continue
        full = array_bytes(shapes.get(instr.operands[int(i.args)], ""), hbm)
        if not full:
            continue
        if i.name in in_place:  # read and written: the update only
            moved += 2 * array_bytes(in_place[i.name])
        else:
            sliced = _sliced_bytes(module, body_list, i.name)
            moved += full if sliced is None else min(full, sliced)
    out = array_bytes(instr.type, hbm)
    if in_place:  # the updated buffers are outputs too, already counted above
        out = max(0.0, out - sum(array_bytes(body[p].type, hbm) for p in in_place))
    return moved + out


def _sliced_bytes(module: Module, body: list[Instr], name: str) -> float | None:
    """Bytes read of fusion parameter ``name`` when every use only slices it (directly,
    through bitcasts or in a nested fusion), else None (the whole operand is read)."""
    root = body[-1] if body else None
    if root is not None and (root.name == name or (root.opcode == "tuple"
                                                   and name in root.operands)):
        return None  # flows out of the fusion whole (a bitcast of a weight, say)
    total = 0.0
    for u in body:
        if name not in u.operands:
            continue
        if u.opcode in SLICING and u.operands[0] == name and u.operands.count(name) == 1:
            total += array_bytes(u.type)
            continue
        if u.opcode == "bitcast":  # the GPU compiler bitcasts a cache before slicing it
            inner = _sliced_bytes(module, body, u.name)
            if inner is None:
                return None
            total += inner
            continue
        nested = module.fused(u) if u.opcode == "fusion" else []
        for index in (k for k, o in enumerate(u.operands) if o == name):
            param = next((p for p in nested if p.opcode == "parameter"
                          and int(p.args) == index), None)
            inner = None if param is None else _sliced_bytes(module, nested, param.name)
            if inner is None:
                return None
            total += inner
    return total


def _plain_bytes(instr: Instr, shapes: dict[str, str], hbm: bool) -> float:
    """Operands read and output written, with slices and in-place updates as in XLA."""
    size = lambda t: array_bytes(t, hbm)
    if instr.opcode in ("dynamic-slice", "slice"):
        return size(instr.type) + array_bytes(instr.type) * bool(
            size(shapes.get(instr.operands[0], "")))
    if instr.opcode == "dynamic-update-slice":
        return 2.0 * size(shapes.get(instr.operands[1], "")) * bool(size(instr.type))
    if instr.opcode.endswith("-start") and instr.type.startswith("(("):
        # an async op's type is ((operands), result, context): read the operands (only the
        # slice of a slice-start) and write the result
        sources, result = tuple_elements(instr.type)[:2]
        read = (array_bytes(result) * bool(size(sources)) if instr.opcode == "slice-start"
                else size(sources))
        return read + size(result)
    if instr.opcode == "copy-start":  # (destination, source, context)
        return sum(size(t) for t in tuple_elements(instr.type)[:2])
    return size(instr.type) + sum(size(shapes.get(o, "")) for o in instr.operands)


def op_costs(text: str) -> list[Op]:
    """Every op that runs in the compiled program whose HLO text is ``text``, with its
    cost (see the module docstring for the counting rules)."""
    module = parse_module(text)
    ops: list[Op] = []

    def walk(name: str, count: int, loops: int, bounded: bool, seen: tuple[str, ...]):
        if name in seen or name not in module.computations:
            return
        body = module.computations[name]
        shapes = {i.name: i.type for i in body}
        defs = {i.name: i for i in body}
        for instr in body:
            if instr.opcode == "while":
                n = trip_count(module, instr, defs)
                bound = scopes.BOUND.search(instr.attrs) if n is None else None
                if n is not None:
                    inner = (count * n, loops, bounded)
                elif bound is not None:
                    inner = (count * int(bound.group(1)), loops, True)
                else:
                    inner = (count, loops + 1, bounded)
                for key in ("condition", "body"):
                    for c in called(instr.attrs, key):
                        walk(c, *inner, seen + (name,))
                continue
            if instr.opcode in ("conditional", "call"):
                for key in ("branch_computations", "true_computation", "false_computation",
                            "to_apply"):
                    for c in called(instr.attrs, key):
                        walk(c, count, loops, bounded, seen + (name,))
                continue
            if (instr.opcode in FREE or instr.opcode.endswith("-done")
                    or FREE_CALLS.intersection(re.findall(r'custom_call_target="(\w+)"',
                                                          instr.attrs))):
                continue
            estimate = (_KERNEL_ESTIMATE.search(instr.attrs)
                        or scopes.KERNEL_COST.search(instr.attrs))
            if instr.opcode == "fusion":
                nbytes = [_fusion_bytes(module, instr, shapes, hbm) for hbm in (False, True)]
                flops = _fused_flops(module, instr)
            elif instr.opcode == "custom-call" and estimate is not None:
                flops, nbytes = float(estimate.group(1)), [float(estimate.group(2))] * 2
            else:
                nbytes = [_plain_bytes(instr, shapes, hbm) for hbm in (False, True)]
                flops = _flops(instr, shapes)
            kind = re.search(r"kind=(\w+)", instr.attrs)
            scope = re.search(r'op_name="([^"]*)"', instr.attrs)
            ops.append(Op(
                name=instr.name, opcode=instr.opcode,
                kind=kind.group(1) if kind and instr.opcode == "fusion" else instr.opcode,
                shape=re.sub(r"\{[^{}]*(?:\([^)]*\)[^{}]*)*\}", "", instr.type),
                bytes=nbytes[0] * count, hbm_bytes=nbytes[1] * count,
                flops=flops * count, count=count, in_loop=loops > 0, inner=loops > 1,
                scope=scope.group(1) if scope else "", source=module.source(instr.attrs),
                bounded=bounded))

    walk(module.entry, 1, 0, False, ())
    return ops


def loop_factors(ops: list[Op]) -> tuple[float, float]:
    """(FLOPs, bytes) of ``ops`` with counted loops run their trip count, over the same
    with every op counted once (as ``cost_analysis`` counts a loop body): 1 without
    such loops, about the depth for a program that scans its layers."""
    ratio = lambda field: (sum(getattr(o, field) for o in ops)
                           / max(sum(getattr(o, field) / o.count for o in ops), 1e-30))
    return ratio("flops"), ratio("bytes")


def totals(ops: list[Op]) -> dict[str, float]:
    """Bytes, HBM bytes and FLOPs summed over ``ops``, and over the per-round ones
    (``loop_``); ``on_chip_once``: the on-chip part of the once-per-call ops' bytes, what
    they moved into on-chip memory (TPU: weights the compiler keeps there across rounds,
    which the per-round HBM bytes then do not read again)."""
    out = {}
    for part, keep in (("", lambda o: True), ("loop_", lambda o: o.in_loop)):
        for field in ("bytes", "hbm_bytes", "flops"):
            out[part + field] = sum(getattr(o, field) for o in ops if keep(o))
    out["on_chip_once"] = sum(o.bytes - o.hbm_bytes for o in ops if not o.in_loop)
    return out


def by_stage(ops, stages) -> dict[str, dict[str, float]]:
    """`totals` of the per-round ops of each stage (and 'other' for the rest)."""
    groups = defaultdict(list)
    for o in ops:
        if o.in_loop:
            groups[o.stage(stages) or "other"].append(o)
    return {k: totals(groups[k]) for k in (*stages, "other") if k in groups}


def table_dict(ops, top: int, stages=()) -> dict:
    """The JSON form of a loop's op table: totals per round and per call, per stage, and
    the ``top`` ops of each kind by bytes."""
    ranked = sorted(ops, key=lambda o: -o.bytes)
    row = lambda o: dataclasses.asdict(o) | {"stage": o.stage(stages)}
    return {"totals": totals(ops), "stages": by_stage(ops, stages),
            "per_round": [row(o) for o in ranked if o.in_loop][:top],
            "once": [row(o) for o in ranked if not o.in_loop][:top]}


def format_table(ops, top: int, stages=()) -> str:
    """A table for people: per-round and once-per-call totals, each stage's share, and
    the ``top`` ops by bytes of each, with their source lines."""
    t = totals(ops)
    once = {k: t[k] - t["loop_" + k] for k in ("bytes", "hbm_bytes", "flops")}
    lines = [(f"  per round: {t['loop_bytes'] / 1e9:.3f} GB accessed "
              f"({t['loop_hbm_bytes'] / 1e9:.3f} GB in HBM), {t['loop_flops'] / 1e9:.2f} "
              f"GFLOP; once per call: {once['bytes'] / 1e9:.3f} GB "
              f"({once['hbm_bytes'] / 1e9:.3f} GB in HBM, {t['on_chip_once'] / 1e9:.3f} GB "
              f"on chip), {once['flops'] / 1e9:.2f} GFLOP")]
    stage_rows = by_stage(ops, stages)
    if len(stage_rows) > 1:
        lines.append("  per round by stage: " + ", ".join(
            f"{k} {v['bytes'] / 1e9:.3f} GB / {v['flops'] / 1e9:.2f} GFLOP"
            for k, v in stage_rows.items()))
    ranked = sorted(ops, key=lambda o: -o.bytes)
    for title, keep in (("per round", True), ("once per call", False)):
        rows = [o for o in ranked if o.in_loop == keep][:top]
        if not rows:
            continue
        lines.append(f"  largest ops {title}:   MB   (HBM)   GFLOP  op, output, stage, source")
        for o in rows:
            count = ((f" x{o.count}" if o.count > 1 else "") + (" (inner loop)" if o.inner else "")
                     + (" (at most)" if o.bounded else ""))
            lines.append(f"    {o.bytes / 1e6:9.1f} {o.hbm_bytes / 1e6:7.1f} {o.flops / 1e9:7.2f}"
                         f"  {o.kind}{count} {o.shape[:48]} {o.stage(stages) or '-'} "
                         f"{o.source or o.scope[-48:]}")
    return "\n".join(lines)


__all__ = ["FREE", "Instr", "Module", "Op", "array_bytes", "by_stage",
           "called", "format_table", "op_costs", "parse_instr", "parse_module", "table_dict",
           "totals", "trip_count", "tuple_elements"]
