"""profile(): where the time of a function goes, by source location.

CPU (and any non-GPU platform): an interpreter runs fn's top-level equations one at
a time, each blocked until ready, after a warm-up run (so compilation of each
primitive is not counted); nested calls (jit, custom_jvp/vjp, control flow) are one
row each, or descended into their bodies with descend=True.

GPU: fn is compiled once and run under jax.profiler's trace; XLA tags each kernel
event with the HLO instruction that launched it ("hlo_op"; library and FFI kernels of
custom calls too), which maps it to that instruction's metadata (op_name,
source_file:source_line). Where the trace has no tags, the kernels are timed with
CUPTI through jax.experimental.mosaic.gpu.profiler.measure(aggregate=False) and
mapped by kernel name, and custom calls' kernels by program order (best effort).
"""
from __future__ import annotations

import dataclasses
import math
import re
import time
from collections import defaultdict

import jax

from jax_ops.fx.graph import Graph, Literal, Node, _table, make_closed_jaxpr


@dataclasses.dataclass
class Row:
    location: str      # file:line (or HLO op_name where no source is known)
    kind: str          # matmul, conv, jax_ops <op>, fusion, reduction, elementwise, call ...
    count: int
    time_us: float
    percent: float = 0.0
    name: str = ""     # primitive / kernel name(s)
    module: str = ""   # Flax module path / name stack
    bytes: int = 0     # operands + results of the row's equations / HLO instructions, once an execution

    @property
    def gbps(self) -> float:
        """bytes / time: the rate at which the row moves its minimum bytes (0 if unknown)."""
        return self.bytes / (self.time_us * 1e3) if self.time_us > 0 and self.bytes else 0.0


class Profile:
    """Rows sorted by time (largest first); str() is a table."""

    def __init__(self, rows, total_us: float, method: str):
        for r in rows:
            r.percent = 100.0 * r.time_us / total_us if total_us > 0 else 0.0
        self.rows = sorted(rows, key=lambda r: -r.time_us)
        self.total_us = total_us
        self.method = method

    def __str__(self):
        header = ("time_us", "percent", "count", "kind", "MB", "GB/s", "location", "module", "name")
        rows = [(f"{r.time_us:.1f}", f"{r.percent:.1f}%", r.count, r.kind,
                 f"{r.bytes / 1e6:.1f}" if r.bytes else "", f"{r.gbps:.0f}" if r.bytes else "",
                 r.location, r.module, r.name[:50]) for r in self.rows]
        return (f"jax_ops.fx.profile ({self.method}): total {self.total_us:.1f} us\n"
                + _table(header, rows))


_ELEMENTWISE = {"add", "sub", "mul", "div", "max", "min", "exp", "log", "rsqrt", "sqrt", "tanh",
                "neg", "abs", "square", "select_n", "convert_element_type", "integer_pow",
                "logistic", "erf", "pow", "sign", "and", "or", "not", "gt", "lt", "ge", "le",
                "eq", "ne", "log1p", "expm1"}


def kind_of_primitive(node: Node) -> str:
    name = node.name
    if name == "dot_general":
        return "matmul"
    if name.startswith("conv"):
        return "conv"
    if name.startswith("jax_ops_"):
        return f"jax_ops {name[len('jax_ops_'):]}"
    if node.subgraphs:
        inner = {n.name for _, g in node.subgraphs for _, n in g.walk()}
        ops = sorted(n[len("jax_ops_"):] for n in inner if n.startswith("jax_ops_"))
        if ops:
            return "jax_ops " + ",".join(ops)
        return "call"
    if name.startswith("reduce_") or name in ("argmax", "argmin", "cumsum"):
        return "reduction"
    if name in _ELEMENTWISE:
        return "elementwise"
    if name in ("broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims", "concatenate",
                "slice", "dynamic_slice", "dynamic_update_slice", "gather", "scatter", "pad"):
        return "data movement"
    return name


def _aval_bytes(avals) -> int:
    n = 0
    for a in avals:
        shape, dtype = getattr(a, "shape", None), getattr(a, "dtype", None)
        if shape is not None and dtype is not None:
            try:
                n += math.prod(shape) * jax.numpy.dtype(dtype).itemsize
            except TypeError:  # extended dtypes (PRNG keys ...): no plain size
                pass
    return n


def node_bytes(node: Node) -> int:
    """The bytes an equation must move at least: its array inputs and outputs, once each."""
    ins = [getattr(a, "aval", None) for a in node.inputs if not isinstance(a, Literal)]
    return _aval_bytes(ins) + _aval_bytes([getattr(o, "aval", None) for o in node.outputs])


def _block(x):
    return jax.block_until_ready(x)


def _run_nodes(graph: Graph, args, times, descend: bool, depth=0):
    env = {}
    for v in graph.consts:
        env[v] = v.const
    for v, a in zip(graph.inputs, args):
        env[v] = a

    def read(a):
        return a.value if isinstance(a, Literal) else env[a]
    for node in graph.nodes:
        vals = [read(a) for a in node.inputs]
        if descend and node.name in ("jit", "pjit", "closed_call", "core_call"):
            outs = _run_nodes(node.subgraphs[0][1], vals, times, descend, depth + 1)
        else:
            t0 = time.perf_counter()
            outs = node.primitive.bind(*vals, **node.primitive.get_bind_params(node.params))
            _block(outs)
            dt = time.perf_counter() - t0
            if times is not None:
                times.append((node, dt))
            if not node.primitive.multiple_results:
                outs = [outs]
        for o, val in zip(node.outputs, outs):
            env[o] = val
    return [read(o) for o in graph.outputs]


def _cpu_profile(fn, args, kwargs, descend: bool, repeat: int) -> Profile:
    closed, in_tree, _, flat = make_closed_jaxpr(fn, args, kwargs)
    graph = Graph.from_jaxpr(closed.jaxpr, closed.consts)
    _run_nodes(graph, flat, None, descend)  # warm-up: per-primitive compilation
    best: dict = {}
    for _ in range(repeat):
        times: list = []
        _run_nodes(graph, flat, times, descend)
        for i, (node, dt) in enumerate(times):
            best[i] = (node, min(dt, best[i][1]) if i in best else dt)
    groups: dict = defaultdict(lambda: [0, 0.0, set(), 0])
    for node, dt in best.values():
        key = (node.location, kind_of_primitive(node), node.module_path)
        g = groups[key]
        g[0] += 1
        g[1] += dt * 1e6
        g[2].add(node.name)
        g[3] += node_bytes(node)
    rows = [Row(loc, kind, c, us, name=",".join(sorted(names)), module=mod, bytes=nbytes)
            for (loc, kind, mod), (c, us, names, nbytes) in groups.items()]
    return Profile(rows, sum(r.time_us for r in rows),
                   f"per-equation wall clock on {jax.default_backend()}, min of {repeat}")


# ---------------------------------------------------------------------- GPU ---

_HLO_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_META = re.compile(r'metadata=\{([^}]*)\}')
_FIELD = re.compile(r'(\w+)="?([^" ]*)"?')


_HLO_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16|f8\w*|c64|c128)\[([\d,]*)\]")
_HLO_BITS = {"pred": 8, "bf16": 16, "c64": 64, "c128": 128}


def _shape_bytes(text: str) -> int:
    n = 0
    for dtype, dims in _HLO_SHAPE.findall(text):
        bits = _HLO_BITS.get(dtype) or (8 if dtype.startswith("f8") else int(dtype[1:]))
        n += math.prod(int(d) for d in dims.split(",") if d) * bits // 8
    return n


def _split_top(text: str) -> list:
    """text split at the commas outside (), [] and {}."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur))
    return parts


_WORKSPACE = re.compile(r"^\s*[su]8\[\d+\]")


def _parts(rhs: str) -> tuple[str, str, str]:
    """(result shape text, opcode, operand list text) of an HLO instruction's right-hand
    side; ("", "", rhs's first field) when it has no operand list."""
    m = re.search(r"\s([a-z][\w\-]*)\(", rhs)
    if not m:
        return rhs.split(",")[0], "", ""
    depth, end = 0, len(rhs)
    for i in range(m.end() - 1, len(rhs)):
        depth += {"(": 1, ")": -1}.get(rhs[i], 0)
        if depth == 0:
            end = i
            break
    return rhs[:m.start()].strip(), m.group(1), rhs[m.end():end]


def instruction_bytes(rhs: str, result_bytes: dict | None = None) -> int:
    """Operand + result bytes of an HLO instruction from its printed right-hand side
    ("bf16[8,16]{1,0} fusion(bf16[8,16]{1,0} %p, f32[16]{0} %q), kind=..."; an operand
    printed without its shape is looked up by name in `result_bytes`): the bytes its
    kernels must move at least, each array once. A custom call's scratch workspace (the
    last element of its result tuple, s8/u8[n]) is not counted."""
    result, opcode, operands = _parts(rhs)
    read = 0
    for operand in _split_top(operands):
        n = _shape_bytes(operand)
        if not n and result_bytes:
            name = re.search(r"%?([\w.\-]+)\s*$", operand.strip())
            n = result_bytes.get(name.group(1), 0) if name else 0
        read += n
    if opcode == "custom-call" and result.startswith("("):
        elements = _split_top(result[1:-1])
        if len(elements) > 1 and _WORKSPACE.match(elements[-1]):
            result = ",".join(elements[:-1])
    return _shape_bytes(result) + read


_SECTION_ROW = re.compile(r'^(\d+)\s+(?:"(.*)"|\{(.*)\})\s*$')


def _stack_tables(hlo_text: str) -> dict:
    """The FileNames/FunctionNames/FileLocations/StackFrames tables newer XLA prints
    before the computations (metadata then refers to a stack_frame_id)."""
    tables: dict = {}
    current = None
    for line in hlo_text.splitlines():
        if line.strip() in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line.strip(), {})
            continue
        m = _SECTION_ROW.match(line.strip()) if current is not None else None
        if m:
            current[int(m.group(1))] = m.group(2) if m.group(2) is not None else \
                {k: int(v) for k, v in re.findall(r"(\w+)=(-?\d+)", m.group(3))}
        elif line.startswith(("%", "ENTRY", "HloModule")) and current is not None and tables:
            current = None
    return tables


def _frame_location(tables: dict, frame_id: int) -> str | None:
    """file:line of the innermost frame outside installed packages on the stack (the
    innermost one if all are), following parent links (printed 1-based: 0 = none)."""
    frames, locs = tables.get("StackFrames", {}), tables.get("FileLocations", {})
    files = tables.get("FileNames", {})
    first = None
    seen = set()
    while frame_id and frame_id in frames and frame_id not in seen:
        seen.add(frame_id)
        frame = frames[frame_id]
        loc = locs.get(frame.get("file_location_id"))
        if loc is not None:
            where = f"{files.get(loc.get('file_name_id'), '?')}:{loc.get('line', '?')}"
            first = first or where
            if not any(p in where for p in ("site-packages", "dist-packages")):
                return where
        frame_id = frame.get("parent_frame_id", 0) - 1
    return first


def hlo_metadata(hlo_text: str) -> tuple[dict, list]:
    """(instruction name -> {op_name, source_file, source_line} for every instruction
    of the compiled HLO (fusions carry their root's metadata), the custom-call
    instructions in program order (the scheduled entry computation's order))."""
    out, custom_calls = {}, []
    tables = _stack_tables(hlo_text)
    instrs = [m for m in map(_HLO_INSTR.match, hlo_text.splitlines()) if m]
    result_bytes = {}  # instruction -> its result's bytes (operands may be printed by name only)
    for m in instrs:
        result_bytes[m.group(1)] = _shape_bytes(_parts(m.group(2))[0])
    for m in instrs:
        meta = _META.search(m.group(2))
        fields = dict(_FIELD.findall(meta.group(1))) if meta else {}
        if "source_file" in fields:
            fields["location"] = f"{fields['source_file']}:{fields.get('source_line', '?')}"
        elif fields.get("stack_frame_id", "").isdigit():
            where = _frame_location(tables, int(fields["stack_frame_id"]))
            if where:
                fields["location"] = where
        target = re.search(r'custom_call_target="([^"]+)"', m.group(2))
        if target:
            fields["custom_call_target"] = target.group(1)
            custom_calls.append(m.group(1))
        fields["bytes"] = instruction_bytes(m.group(2), result_bytes)
        out[m.group(1)] = fields
    return out, custom_calls


def _kernel_kind(kernel: str, instr: str | None, op_name: str, target: str = "") -> str:
    k = (kernel + " " + target).lower()
    if "jax_ops" in k or "jax_ops" in op_name:
        m = re.search(r"jax_ops[_:]+(\w+)", kernel + " " + op_name)
        return f"jax_ops {m.group(1)}" if m else "jax_ops"
    if (instr or "").startswith("cudnn-conv") or op_name.rsplit("/", 1)[-1].startswith("conv_general_dilated"):
        return "conv"  # cuDNN's convolution kernels are implicit GEMMs: named like matmuls
    if any(s in k for s in ("gemm", "xmma", "cutlass", "cublas", "matmul", "dot")):
        return "matmul"
    if re.search(r"conv(?!ert)", k):  # a convolution, not a convert_element_type fusion
        return "conv"
    if "reduce" in k or "reduction" in k:
        return "reduction fusion"
    if "fusion" in k or (instr and "fusion" in instr):
        return "fusion"
    return "kernel"


def _family(name: str) -> str:
    """Which custom calls launch a kernel of this name (or a call of this target):
    cuBLAS, our FFI kernels (namespace jax_ops), or others (Triton/Pallas...)."""
    n = name.lower()
    if any(s in n for s in ("gemm", "xmma", "cutlass", "cublas", "matmul")):
        return "cublas"
    if "jax_ops" in n:
        return "jax_ops"
    return "other"


def rows_from_trace(events, meta: dict, repeat: int) -> list | None:
    """Rows from profiler-trace kernel events [(kernel name, ns, {stat: value})]: XLA
    tags each kernel it launches with the HLO instruction (stat "hlo_op"), custom
    calls' library and FFI kernels included, so the attribution is exact. None when
    no event carries the tag (then the CUPTI mapping by name and order is used)."""
    groups: dict = defaultdict(lambda: [0, 0.0, set()])
    moved = _InstructionBytes()
    tagged = False
    for kernel, ns, stats in events:
        instr = stats.get("hlo_op")
        if not instr:
            continue
        tagged = True
        fields = meta.get(instr, {})
        loc = fields.get("location") or fields.get("op_name") or f"(instruction {instr})"
        kind = _kernel_kind(kernel, instr, fields.get("op_name", ""),
                            fields.get("custom_call_target", ""))
        key = (loc, kind, fields.get("op_name", ""))
        g = groups[key]
        g[0] += 1
        g[1] += ns / 1e3
        g[2].add(kernel)
        moved.add(instr, key, ns, kernel)
    if not tagged:
        return None
    nbytes = moved.by_row(meta, repeat)
    return [Row(loc, kind, max(1, round(c / repeat)), us / repeat, name=",".join(sorted(n)), module=op,
                bytes=nbytes.get((loc, kind, op), 0))
            for (loc, kind, op), (c, us, n) in groups.items()]


class _InstructionBytes:
    """Each HLO instruction's bytes, put in the one row that has most of its time (a
    memset and a reduction of one instruction can land in two rows; the bytes are
    counted once), times its executions per run (a loop body's run several times,
    estimated as its kernel events per distinct kernel name)."""

    def __init__(self):
        self.time = defaultdict(lambda: defaultdict(float))  # instr -> row key -> time
        self.events = defaultdict(int)
        self.kernels = defaultdict(set)

    def add(self, instr, key, t, kernel):
        self.time[instr][key] += t
        self.events[instr] += 1
        self.kernels[instr].add(kernel)

    def by_row(self, meta: dict, runs: int) -> dict:
        out: dict = defaultdict(int)
        for instr, by_key in self.time.items():
            b = meta.get(instr, {}).get("bytes", 0)
            executions = self.events[instr] / len(self.kernels[instr]) / runs
            if b:
                out[max(by_key, key=by_key.get)] += int(round(b * max(1.0, executions)))
        return out


def _trace_events(compiled, args, kwargs, repeat: int, module: str) -> list:
    """Kernel events of `repeat` runs of `compiled` under jax.profiler.trace: (name,
    duration ns, stats) from the GPU planes, for this module's kernels."""
    import glob
    import os
    import tempfile
    jax.block_until_ready(compiled(*args, **kwargs))  # warm
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        try:
            for _ in range(repeat):
                jax.block_until_ready(compiled(*args, **kwargs))
        finally:
            jax.profiler.stop_trace()
        paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        if not paths:
            return []
        data = jax.profiler.ProfileData.from_file(paths[0])
    events = []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            for ev in line.events:
                stats = {k: v for k, v in ev.stats}
                mod = str(stats.get("hlo_module", ""))
                if mod and module and not mod.startswith(module):
                    continue
                events.append((ev.name, ev.duration_ns, stats))
    return events


def _lower_with_user_locations(fn, args, kwargs):
    """jit(fn).lower with jax_ops' and pallas_kernels' own frames excluded from the HLO
    source metadata (as jax's are), so our ops' kernels point at the user's line."""
    import os
    from jax._src import source_info_util  # private: register_exclusion / _exclude_paths
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # jax_ops/
    paths = [here, os.path.join(os.path.dirname(here), "pallas_kernels")]
    added = [p for p in paths if p not in source_info_util._exclude_paths]
    for p in added:
        source_info_util.register_exclusion(p)
    try:
        return jax.jit(fn).lower(*args, **kwargs)
    finally:
        for p in added:
            source_info_util._exclude_paths.remove(p)


def _gpu_profile(fn, args, kwargs, repeat: int) -> Profile:
    lowered = _lower_with_user_locations(fn, args, kwargs)
    # Kernels replayed inside a CUDA graph are tagged with the command buffer, not their
    # instruction: the trace path compiles without command buffers (same kernels).
    for options in ({"xla_gpu_enable_command_buffer": ""}, None):
        try:
            compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
            meta, custom_calls = hlo_metadata(compiled.as_text())
            module = re.search(r"HloModule\s+([\w.\-]+)", compiled.as_text()).group(1)
            rows = rows_from_trace(_trace_events(compiled, args, kwargs, repeat, module), meta, repeat)
        except Exception:  # no such option / profiler plugin / trace format
            rows = None
        if rows:
            return Profile(rows, sum(r.time_us for r in rows),
                           f"profiler trace (kernels tagged with their HLO instruction"
                           f"{'; command buffers off' if options else ''}), mean of {repeat}")
    compiled = lowered.compile()
    meta, custom_calls = hlo_metadata(compiled.as_text())
    return _cupti_profile(compiled, meta, custom_calls, args, kwargs, repeat)


def _cupti_profile(compiled, meta, custom_calls, args, kwargs, repeat: int) -> Profile:
    from jax.experimental.mosaic.gpu import profiler
    by_sanitized = {re.sub(r"[^\w]", "_", k): k for k in meta}
    # Kernels not named after an instruction (cuBLAS, our FFI and Pallas kernels) are
    # launched by custom calls: each goes to the next custom call of its family in
    # program order (best effort: a call launching several kernels shifts the rest).
    pending = list(custom_calls)
    # measure() runs the compiled executable once to warm up, then times `repeat` runs
    # (kernel name, ms) each.
    _, per_run = profiler.measure(compiled, aggregate=False, iterations=repeat)(*args, **kwargs)
    if per_run and isinstance(per_run[0], tuple):
        per_run = [per_run]
    # Kernels of the fastest run (CUPTI: launch order, ms each).
    run = min(per_run or [[]], key=lambda r: sum(t for _, t in r))
    instrs = []
    for kernel, _ in run:
        instr = kernel if kernel in meta else by_sanitized.get(re.sub(r"[^\w]", "_", kernel))
        if instr is None:
            family = _family(kernel)
            instr = next((c for c in pending if _family(meta[c].get("custom_call_target", "")) == family),
                         None)
        if instr in pending:
            pending.remove(instr)
        instrs.append(instr)
    # A library kernel launched inside an instruction no custom call stands for (cuBLAS
    # running XLA's gemm fusions, seen on the H100) goes to its nearest named neighbour
    # in launch order, the previous one first.
    for i, instr in enumerate(instrs):
        if instr is None:
            near = [instrs[j] for j in (i - 1, i + 1) if 0 <= j < len(instrs) and instrs[j]]
            instrs[i] = near[0] if near else None
    groups: dict = defaultdict(lambda: [0, 0.0, set()])
    moved = _InstructionBytes()
    for (kernel, ms), instr in zip(run, instrs):
        fields = meta.get(instr, {}) if instr else {}
        loc = fields.get("location") or fields.get("op_name") or f"(kernel {kernel[:40]})"
        kind = _kernel_kind(kernel, instr, fields.get("op_name", ""),
                            fields.get("custom_call_target", ""))
        key = (loc, kind, fields.get("op_name", ""))
        g = groups[key]
        g[0] += 1
        g[1] += ms * 1e3
        g[2].add(kernel)
        if instr:
            moved.add(instr, key, ms, kernel)
    nbytes = moved.by_row(meta, 1)
    rows = [Row(loc, kind, c, us, name=",".join(sorted(n)), module=op, bytes=nbytes.get((loc, kind, op), 0))
            for (loc, kind, op), (c, us, n) in groups.items()]
    return Profile(rows, sum(r.time_us for r in rows), f"CUPTI kernel times, best of {repeat}")


def profile(fn, *args, descend: bool = False, repeat: int = 3, **kwargs) -> Profile:
    """Where the time of fn(*args, **kwargs) goes: rows with location, kind, count,
    time_us, percent, bytes (operands + results of the row's equations or HLO
    instructions, each once per execution: the minimum they move) and gbps, sorted by
    time. On GPU: CUPTI per-kernel times of the compiled function mapped to HLO source
    metadata; elsewhere: per-equation wall
    clock of an eager run (descend=True times the bodies of jit calls equation by
    equation instead of as one row)."""
    if not callable(fn):
        raise TypeError(f"jax_ops.fx.profile: fn must be callable; got {type(fn).__name__}")
    if not isinstance(repeat, int) or isinstance(repeat, bool) or repeat < 1:
        raise ValueError(f"jax_ops.fx.profile: repeat must be an int >= 1; got {repeat!r}")
    if jax.default_backend() == "gpu":
        try:
            return _gpu_profile(fn, args, kwargs, repeat)
        except (ImportError, RuntimeError) as e:  # no CUPTI (mosaic GPU extension) here
            prof = _cpu_profile(fn, args, kwargs, descend, repeat)
            prof.method += f" (CUPTI unavailable: {e})"
            return prof
    return _cpu_profile(fn, args, kwargs, descend, repeat)
