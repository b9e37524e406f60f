"""Standalone kernels: ``pitgen emit`` writes ``<name>.cu`` and ``<name>.h``, a kernel with a C
API that other projects build with nvcc alone (no Python, PyCUDA or pitgen).

The device code is the JIT path's: each variant is a :class:`~pitgen.lower.ModuleSpec` rendered
with ``module.cu.j2``; ``host.cu.j2`` wraps the variants with host functions that launch what
:class:`~pitgen.ops.matmul.GemmCall` launches, and ``header.h.j2`` declares them. An emitted kernel
takes row-major operands of any extents, so what lowering decides from extents and pointers
(copy widths, paired stores) is decided here for all of them: a kernel gets a *wide* variant,
lowered for friendly extents and 16-byte aligned pointers, and a *narrow* one, lowered for odd
extents and element-aligned pointers. What the
wide variant requires is found by asking :func:`~pitgen.lower.lower` itself, one extent or
pointer at a time, so a call only ever runs a variant that lowering would allow for its operands.
"""
from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence, TextIO

from .compiler import find_nvcc
from .errors import CompileError, FileError, PitgenError, PlanError
from .expr import Operator, parse
from .lower import DTYPES, GemmForm, Layout, ModuleSpec, Schedule, gemm_form, lower
from .planner import Candidate, make_plan, parse_tile
from .ops.matmul import MATMUL
from .render import render_template, template_dir

#: Opt-in shared memory per block (bytes) of the archs the kernels run on: cp.async and
#: mma.sync need sm_80 or newer (CUDA C++ Programming Guide, compute capabilities table).
#: sm_90a: Hopper's arch-specific features (wgmma, TMA, setmaxnreg), for the wgmma kernel.
ARCH_SMEM = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_87": 163 * 1024, "sm_89": 99 * 1024,
             "sm_90": 227 * 1024, "sm_90a": 227 * 1024, "sm_100": 227 * 1024,
             "sm_120": 99 * 1024}
#: The device arch lowering plans for, per emit arch: sm_90a files get the JIT path's wgmma
#: kernel (the device arch "sm_90" compiles its modules for sm_90a); a source for any other arch
#: keeps to mma.sync, which every arch from sm_80 on runs.
LOWERING_ARCH = {"sm_90a": "sm_90"}
#: Shared memory kept for the kernels' static arrays (row ids) on top of the pipeline's.
STATIC_SMEM = 1024
DEFAULT_ARCH = "sm_80"
DEFAULT_DTYPE = "float16"
#: Names the C API uses itself (its parameters, and the locals p, w, e of the functions that take
#: the tensors and axes as parameters): a tensor or axis of the expression cannot be called so.
RESERVED = frozenset({"workspace", "workspace_bytes", "stream", "bytes", "pit_host", "p", "w", "e"})
#: C, C++ and CUDA keywords and alternative tokens, and the types, values and macros of the
#: headers the emitted files include or use: a tensor or axis named so would not compile (a
#: parameter named ``int``) or would change what a name in the generated code means (``dim3``).
CPP_NAMES = frozenset("""
    alignas alignof and and_eq asm auto bitand bitor bool break case catch char char8_t char16_t
    char32_t class compl concept const consteval constexpr constinit const_cast continue
    co_await co_return co_yield decltype default delete do double dynamic_cast else enum
    explicit export extern false float for friend goto if inline int long mutable namespace new
    noexcept not not_eq nullptr operator or or_eq private protected public register
    reinterpret_cast requires restrict return short signed sizeof static static_assert
    static_cast struct switch template this thread_local throw true try typedef typeid typename
    union unsigned using virtual void volatile wchar_t while xor xor_eq _Bool _Complex
    __global__ __device__ __host__ __shared__ __constant__ __managed__ __restrict__
    __forceinline__ __noinline__ __launch_bounds__ __syncthreads
    int8_t int16_t int32_t int64_t uint8_t uint16_t uint32_t uint64_t intptr_t uintptr_t
    size_t ptrdiff_t ssize_t max_align_t NULL offsetof assert errno std EOF NAN INFINITY HUGE_VAL
    dim3 threadIdx blockIdx blockDim gridDim warpSize half half2 float2 float4 int2 int4 uint4
    nv_bfloat16 nv_bfloat162 min max abs
""".split())
#: Longest tensor or axis name of an emitted kernel (it becomes part of file and function names).
MAX_NAME = 64
_DTYPE_TAGS = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}
#: Extents around which lowering is probed (multiples of 64: a shift by d < 64 leaves exactly
#: the factors of two of d).
_PROBE_EXTENT = 1024
_SHIFTS = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class Request:
    """What ``pitgen emit`` is asked for: everything the emitted files depend on."""

    expr: str
    sparse: str
    micro_tile: str
    dtype: str = DEFAULT_DTYPE
    tile: str | None = None
    arch: str = DEFAULT_ARCH

    def command(self) -> str:
        """The command that writes these files again, into the current directory."""
        parts = ["pitgen", "emit", shlex.quote(self.expr), "--sparse", self.sparse, "--dtype",
                 self.dtype, "--micro-tile", self.micro_tile]
        if self.tile:
            parts += ["--tile", self.tile]
        return " ".join(parts + ["--arch", self.arch, "--out", "."])


CATALOGUE_EXPR = "C[m,n] += A[m,k] * B[k,n]"
#: ``generated/``: A sparse along k (32x1 micro-tiles), along m (1x64) and in 64x64 blocks, for
#: sm_80 on; and in 128x128 blocks (the block-sparse libraries' granularity) on Hopper's wgmma
#: kernel, for sm_90a.
CATALOGUE = tuple(Request(CATALOGUE_EXPR, "A", micro_tile, dtype)
                  for dtype in ("float16", "bfloat16") for micro_tile in ("32x1", "1x64", "64x64")
                  ) + tuple(Request(CATALOGUE_EXPR, "A", "128x128", dtype, arch="sm_90a")
                            for dtype in ("float16", "bfloat16"))


@dataclass(frozen=True)
class Requirement:
    """What a wide variant needs: ``multiple``: extent ``what`` (M, N or K of the normalised
    problem) a multiple of ``value``; ``aligned``: pointer ``what`` (a, b or c) aligned to
    ``value`` bytes."""

    kind: str
    what: str
    value: int

    def holds(self, extents: dict[str, int], align: dict[str, int]) -> bool:
        if self.kind == "multiple":
            return extents[self.what] % self.value == 0
        return align[self.what] % self.value == 0


@dataclass(frozen=True)
class Variant:
    """One compiled tile kernel, run when its requirements hold (the last one: always)."""

    tag: str
    spec: ModuleSpec
    needs: tuple[Requirement, ...]


@dataclass(frozen=True)
class Emitted:
    """One standalone kernel: its variants, and its files by name (not yet written)."""

    name: str
    request: Request
    variants: tuple[Variant, ...]
    files: dict[str, str]

    @property
    def summary(self) -> str:
        """What the kernel is, in one line (``pitgen emit --list``)."""
        spec = self.variants[0].spec
        g = spec.gemm
        along = f" along {spec.plan_axis}" if spec.plan_axis else ""
        return (f"{self.request.dtype:<9} {spec.plan_kind} {self.request.micro_tile}{along}, "
                f"tile {g.bm}x{g.bn}x{g.bk} ({g.mainloop}), {self.request.arch}")

    def pick(self, extents: dict[str, int], align: dict[str, int]) -> Variant:
        """The variant the emitted host code runs for these operands (mirrors host.cu.j2)."""
        return next(v for v in self.variants if all(n.holds(extents, align) for n in v.needs))


def _check_arch(arch: str) -> int:
    if arch not in ARCH_SMEM:
        raise PlanError(f"unknown arch {arch!r}: the kernels need sm_80 or newer, one of "
                        f"{', '.join(ARCH_SMEM)}")
    return ARCH_SMEM[arch]


def _row_major(op: Operator, form: GemmForm, ext: dict[str, int], align: tuple[int, int, int]) -> Layout:
    """The normalised layout of contiguous operands with extents ``ext`` (keys M, N, K)."""
    axis_ext = {form.m_axis: ext["M"], form.n_axis: ext["N"], form.k_axis: ext["K"]}
    strides = {acc.tensor: {acc.axes[0]: axis_ext[acc.axes[1]], acc.axes[1]: 1}
               for acc in (op.output, *op.inputs)}
    s, d, o = strides[form.sparse], strides[form.dense], strides[form.out]
    return Layout(ext["M"], ext["N"], ext["K"], (s[form.m_axis], s[form.k_axis]),
                  (d[form.k_axis], d[form.n_axis]), (o[form.m_axis], o[form.n_axis]), *align)


def _stride_names(op: Operator, form: GemmForm) -> dict[str, str]:
    """Element strides of the row-major operands as extents of the normalised problem."""
    name = {form.m_axis: "M", form.n_axis: "N", form.k_axis: "K"}
    strides = {acc.tensor: {acc.axes[0]: name[acc.axes[1]], acc.axes[1]: "1"}
               for acc in (op.output, *op.inputs)}
    s, d, o = strides[form.sparse], strides[form.dense], strides[form.out]
    return {"sa_m": s[form.m_axis], "sa_k": s[form.k_axis], "sb_k": d[form.k_axis],
            "sb_n": d[form.n_axis], "sc_m": o[form.m_axis], "sc_n": o[form.n_axis]}


def _variants(op: Operator, form: GemmForm, choice: Candidate, dtype: str,
              schedule: Schedule, arch: str) -> list[tuple[ModuleSpec, tuple[Requirement, ...]]]:
    """[(spec, requirements)], the widest variant first (on sm_90a, the wgmma kernel where the
    plan allows it: its operands must be ones TMA can map). Micro-tiles along m are probed with
    K past the micro-tile's extent, where lowering keeps it (it clips one that covers K): the
    kernel's k-tiles are then those of the plan, and it runs for any K."""
    size = DTYPES[dtype]
    rows = choice.kind == "micro" and choice.axis == form.m_axis
    tk = choice.shape[form.a_dims[1]]
    base = {"M": _PROBE_EXTENT, "N": _PROBE_EXTENT,
            "K": (tk // 64 + 1) * 64 if rows else _PROBE_EXTENT}
    aligns = [n for n in (2, 4, 8, 16) if n > size]

    def at(shift: dict[str, int], align: dict[str, int]) -> ModuleSpec:
        ext = {x: b + shift.get(x, 0) for x, b in base.items()}
        lay = _row_major(op, form, ext,
                         (align.get("a", 16), align.get("b", 16), align.get("c", 16)))
        return lower(op, form.sparse, choice.kind, choice.axis, choice.shape, dtype, lay,
                     schedule=schedule, arch=LOWERING_ARCH.get(arch, "sm_80"))

    wide = at({}, {})
    narrow = at({"M": 1, "N": 1, "K": 1}, {"a": size, "b": size, "c": size})
    needs = []
    for x in "MNK":  # the smallest factor of two of x that still gets the wide spec
        d = next((d for d in _SHIFTS if at({x: d}, {}) == wide), 64)
        if d > 1:
            needs.append(Requirement("multiple", x, d))
    for t in "abc":  # the smallest alignment of pointer t that still gets it
        n = next((n for n in (size, *aligns) if at({}, {t: n}) == wide), 16)
        if n > size:
            needs.append(Requirement("aligned", t, n))
    least = at({r.what: r.value % 64 for r in needs if r.kind == "multiple"},
               {r.what: r.value for r in needs if r.kind == "aligned"})
    if least != wide:  # lowering's conditions are no longer one per extent and pointer
        raise PitgenError(f"pitgen bug: the requirements {needs} of the wide variant of "
                          f"{op.text!r} do not reproduce it")
    if not needs or narrow == wide:
        return [(wide, ())]
    return [(wide, tuple(needs)), (narrow, ())]


@functools.cache
def _template_macros() -> frozenset[str]:
    """Every macro the templates #define: a parameter so named would be replaced by it."""
    return frozenset(m for p in template_dir().glob("*.j2")
                     for m in re.findall(r"#define\s+([A-Za-z_]\w*)", p.read_text()))


def _check_names(op: Operator) -> None:
    """Tensor and axis names become C identifiers (parameters, enum constants, a file name):
    each must be one that the emitted code can take as its own, or the kernel is refused."""
    for name in dict.fromkeys((op.output.tensor, *op.input_names, *op.axes)):
        why = None
        if name in RESERVED:
            why = "would clash with a parameter of the C API"
        elif name in CPP_NAMES or name in _template_macros():
            why = "is a C/C++/CUDA keyword or a name the emitted code uses"
        elif re.fullmatch(r"[A-Z][A-Z0-9]*_[A-Z0-9_]*", name):
            why = "is spelled as a macro (capitals with an underscore), which a header may define"
        elif name.startswith("_") or "__" in name:
            why = "is reserved in C/C++ (a leading underscore or a double underscore)"
        elif name.lower().startswith(("pit_", "pitgen", "cuda", "cu_", "nv_")):
            why = "uses a prefix of pitgen's or CUDA's own names (pit_, pitgen, cuda, cu_, nv_)"
        elif len(name) > MAX_NAME:
            why = f"is longer than {MAX_NAME} characters"
        if why:
            raise PlanError(f"name {name[:MAX_NAME]!r} {why}: rename it for pitgen emit")


def kernel_name(req: Request, op: Operator, form: GemmForm, choice: Candidate) -> str:
    """``pit_matmul[_at][_bt][_ct]_<sparse>_<dtype>_<micro-tile>[_t<tile>]_<arch>``: readable,
    and a function of the request (``at``/``bt``: an input stored k-major/n-major; ``ct``: the
    output stored transposed)."""
    x, y = op.inputs
    k = form.k_axis
    form_tag = ["matmul"]
    if x.axes[0] == k:
        form_tag.append("at")
    if y.axes[1] == k:
        form_tag.append("bt")
    if next(a for a in x.axes if a != k) != op.output.axes[0]:
        form_tag.append("ct")
    shape = "x".join(map(str, choice.shape))
    micro = f"{choice.axis}{shape}" if choice.kind == "micro" else f"block{shape}"
    parts = ["pit", *form_tag, req.sparse.lower(), _DTYPE_TAGS[req.dtype], micro]
    if req.tile:
        parts.append("t" + req.tile)
    return "_".join(parts + [req.arch.replace("_", "")])


def _normalised(req: Request, op: Operator) -> Request:
    """``req`` with the tile in canonical form ("64x64x32" in axis order), so that equal
    requests get equal names and files."""
    if req.tile is None:
        return req
    given = parse_tile(op, req.tile)
    return replace(req, tile="x".join(str(given[a]) for a in op.axes))


def emit(req: Request) -> Emitted:
    """Plan, lower and render one standalone kernel. Every refusal (PitgenError) happens here,
    before anything is written."""
    for field, value in vars(req).items():
        if not isinstance(value, str) and not (field == "tile" and value is None):
            raise PlanError(f"emit's {field} must be a string (as on the command line), got "
                            f"{value!r}")
    if req.dtype not in DTYPES:
        raise PlanError(f"dtype {req.dtype!r} has no GPU kernel (supported: {', '.join(DTYPES)})")
    smem_limit = _check_arch(req.arch)
    op = parse(req.expr)
    if not req.micro_tile or req.micro_tile.strip() in ("auto", "dense"):
        raise PlanError("pitgen emit needs the micro-tile or block of the sparse operand "
                        "(e.g. --micro-tile 32x1): with no mask to plan from, a kernel would be dense")
    plan = make_plan(op, req.sparse, micro_tile=req.micro_tile, tile=req.tile)
    choice = plan.choice
    form = gemm_form(op, req.sparse)
    _check_names(op)
    req = replace(_normalised(req, op), micro_tile="x".join(map(str, choice.shape)))
    schedule = Schedule()
    if req.tile is not None:
        ct = plan.compute_tile
        schedule = Schedule(bn=ct[form.n_axis], bk=ct[form.k_axis])
    name = kernel_name(req, op, form, choice)
    found = _variants(op, form, choice, req.dtype, schedule, req.arch)
    variants = tuple(Variant(("wide" if needs else "narrow") if len(found) > 1 else "main", spec,
                             needs) for spec, needs in found)
    specs = [v.spec for v in variants]
    # one index pass serves every variant: the first's (which also orders the m-tiles where
    # it is the wgmma kernel; the mma.sync variants ignore the order)
    if len({replace(s.index, ordered=False) if s.index else None for s in specs}) > 1:
        raise PitgenError(f"pitgen bug: the variants of {name} disagree on the index")
    smem = max(s.gemm.smem_bytes(req.dtype) for s in specs)
    if smem + STATIC_SMEM > smem_limit:
        g = specs[0].gemm
        raise PlanError(f"tile {g.bm}x{g.bn}x{g.bk} with {g.stages} stages needs {smem} bytes of "
                        f"shared memory; {req.arch} gives a block at most {smem_limit - STATIC_SMEM}")
    emitted = Emitted(name, req, variants, {})
    ctx = _context(emitted, op, form, plan.rules, smem)
    files = {f"{name}.cu": render_template("host.cu.j2", **ctx),
             f"{name}.h": render_template("header.h.j2", **ctx)}
    return replace(emitted, files=files)


def _context(e: Emitted, op: Operator, form: GemmForm, rules, smem: int) -> dict:
    """Everything the templates spell out, as plain data."""
    req = e.request
    first = e.variants[0].spec
    g, ix = first.gemm, first.index
    sparse_axes = op.access(form.sparse).axes
    variants = []
    for v in e.variants:
        kernel = f"{e.name}_{v.tag}"
        index = replace(ix, name=f"{e.name}_index") if v is e.variants[0] else None
        spec = replace(v.spec, gemm=replace(v.spec.gemm, name=kernel), index=index)
        vg = v.spec.gemm
        variants.append({"tag": v.tag, "ns": f"{kernel}_module", "kernel": kernel,
                         "source": MATMUL.source(spec.context()).rstrip("\n"), "needs": v.needs,
                         "a_vec": vg.a_vec, "b_vec": vg.b_vec, "c_pair": vg.c_pair,
                         "wgmma": vg.mainloop == "wgmma", "bn": vg.bn, "bk": vg.bk,
                         "threads": vg.threads, "smem": vg.smem_bytes(req.dtype),
                         "a_kcontig": vg.a_smem_kcontig, "b_ncontig": vg.b_smem_ncontig,
                         "c_vec": vg.c_vec})
    rule = None
    if first.plan_kind == "micro":
        ar = rules.axes[first.plan_axis]
        rule = {"axis": ar.axis, "role": ar.role, "needs": list(ar.needs), "reason": ar.reason}
    return {
        "name": e.name, "guard": f"PITGEN_{e.name.upper()}_H",
        "command": req.command(), "expression": op.text, "dtype": req.dtype, "arch": req.arch,
        "axes": list(op.axes),
        "tensors": [{"name": a.tensor, "axes": list(a.axes)} for a in (*op.inputs, op.output)],
        "inputs": [{"name": a.tensor} for a in op.inputs],
        "form": {"m": form.m_axis, "n": form.n_axis, "k": form.k_axis, "sparse": form.sparse,
                 "dense": form.dense, "out": form.out},
        "user": {"M": form.m_axis, "N": form.n_axis, "K": form.k_axis, "a": form.sparse,
                 "b": form.dense, "c": form.out},
        "plan": {"shape": req.micro_tile, "grain": list(zip(sparse_axes, first.plan_shape))},
        "rule": rule,
        "tile": {"bm": g.bm, "bn": g.bn, "bk": g.bk, "warps": g.wm * g.wn, "threads": g.threads,
                 "stages": g.stages, "smem": smem, "wgmma": g.mainloop == "wgmma"},
        "sm90a": req.arch == "sm_90a",
        "ordered": g.mainloop == "wgmma" and g.block_list,  # the index pass sorts the m-tiles
        "a_mode": g.a_mode, "ksub": g.ksub, "packed": g.a_mode == "packed",
        "tk": first.plan_shape[form.a_dims[1]] if g.a_mode == "rows" else 0,
        "index_kernel": f"{e.name}_index",
        # tiles one block of the index kernel tests, as pitgen.ops.matmul.Launcher launches it
        "index_per_block": ix.per_block,
        "strides": _stride_names(op, form),
        "variants": variants,
    }


def emit_all(requests: Sequence[Request], progress: Progress | None = None) -> list[Emitted]:
    """Emit several kernels; all are rendered (and refused) before any is written."""
    out = []
    for req in requests:
        out.append(emit(req))
        if progress:
            progress.advance(out[-1].name)
    names = [e.name for e in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise PlanError(f"several requests make the same kernel: {', '.join(dup)}")
    return out


def write(items: Sequence[Emitted], out: Path) -> list[Path]:
    """Write the files of ``items`` into ``out`` (created if needed); returns their paths."""
    if out.exists() and not out.is_dir():
        raise FileError(f"{out} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        paths = []
        for item in items:
            for fname, text in item.files.items():
                path = out / fname
                path.write_bytes(text.encode())
                paths.append(path)
    except OSError as e:
        raise FileError(f"cannot write into {out}: {e.strerror or e}") from None
    return paths


def listing(items: Sequence[Emitted]) -> str:
    """One line per kernel: name and what it is."""
    width = max(len(e.name) for e in items)
    return "\n".join(f"{e.name:<{width}}  {e.summary}" for e in items)


def compile_objects(sources: Sequence[Path], archs: Sequence[str], out: Path, jobs: int = 2,
                    progress: Progress | None = None) -> list[Path]:
    """``nvcc -c`` each emitted source into ``out``, with device code for every arch in
    ``archs``: the check that emitted files build with nvcc alone (no GPU needed)."""
    for arch in archs:
        _check_arch(arch)
    nvcc = find_nvcc()
    gencode = [f"-gencode=arch=compute_{a[3:]},code={a}" for a in archs]

    def one(src: Path) -> Path:
        obj = out / f"{src.stem}.o"
        proc = subprocess.run([nvcc, "-std=c++17", "-O3", *gencode, "-c", str(src), "-o", str(obj)],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise CompileError(f"nvcc failed on {src.name} ({', '.join(archs)}):\n{proc.stderr[-4000:]}")
        if progress:
            progress.advance(src.name)
        return obj

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        return list(pool.map(one, sources))


class Progress:
    """A one-line progress bar on stderr, for several items (silent for one): redrawn in place
    on a terminal, a line per item otherwise (logs)."""

    def __init__(self, what: str, total: int, stream: TextIO | None = None):
        self.what, self.total, self.done = what, total, 0
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.width = 0
        self.lock = threading.Lock()

    def advance(self, label: str) -> None:
        with self.lock:
            self.done += 1
            if self.total < 2:
                return
            bar = "#" * (24 * self.done // self.total)
            line = f"{self.what} [{bar:<24}] {self.done}/{self.total} {label}"
            if self.tty:
                end = "\n" if self.done == self.total else ""
                self.stream.write("\r" + line.ljust(self.width) + end)
                self.width = len(line)
            else:
                self.stream.write(line + "\n")
            self.stream.flush()


def jobs() -> int:
    """Parallel nvcc processes: one per core available to this process."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
