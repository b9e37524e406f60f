"""Runtime: compiled modules loaded through PyCUDA and launched on PyTorch tensors or PyCUDA
GPUArrays, in the caller's stream, with no host synchronisation between index build and compute.

PyCUDA shares PyTorch's (primary) context: ``pycuda.autoprimaryctx`` keeps it current in the
main thread, and any other thread pushes it for the length of a call (``bound_context``), so
operators run from autograd's backward thread or a worker pool alike. When the current torch
stream is not the legacy default stream, launches go to a PyCUDA stream that is ordered after
the torch stream and before its later work with stream waits (GPU-side, no host sync).
"""
from __future__ import annotations

import hashlib
import sys
import threading
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import numpy as np

from .compiler import compile_source
from .errors import DeviceError, PlanError, ShapeError
from .expr import Operator
from .lower import GemmForm, Layout, ModuleSpec, Schedule, lower
from .render import render, render_template

GRID_Y_MAX = 65535


_DRV: list[Any] = []


def _drv():
    """pycuda.driver, initialised; DeviceError when unusable. In the main thread PyTorch's
    primary context is made current for good (``pycuda.autoprimaryctx``, which pops it at exit);
    other threads get it from ``bound_context`` for the length of a call. Every launch calls
    this, so once that is done it returns at once."""
    main = threading.current_thread() is threading.main_thread()
    if _DRV and (not main or "pycuda.autoprimaryctx" in sys.modules):
        return _DRV[0]
    try:
        try:
            import torch
            if torch.cuda.is_available():
                torch.cuda.init()
        except ImportError:
            pass
        import pycuda.driver as drv
        if main:
            import pycuda.autoprimaryctx  # noqa: F401  (retains and pushes the primary context)
        else:
            drv.init()
            _primary_context(drv)
    except ImportError as e:
        raise DeviceError(f"pycuda is not installed ({e}); pip install 'pitgen[cuda]'") from None
    except Exception as e:  # driver missing, no device
        raise DeviceError(f"no usable CUDA device: {e}") from None
    _DRV[:] = [drv]
    return drv


_PRIMARY: list[Any] = []


def _primary_context(drv: Any) -> Any:
    """The primary context PyTorch uses: autoprimaryctx's once imported, else retained here for
    torch's current device (the same CUcontext, so modules loaded under either work in both)."""
    auto = sys.modules.get("pycuda.autoprimaryctx")
    if auto is not None:
        return auto.context
    if not _PRIMARY:
        try:
            import torch
            dev = torch.cuda.current_device() if torch.cuda.is_available() else 0
        except ImportError:
            dev = 0
        _PRIMARY.append(drv.Device(dev).retain_primary_context())
    return _PRIMARY[0]


@contextmanager
def bound_context() -> Iterator[Any]:
    """pycuda.driver with the shared primary context current in this thread while the block
    runs: a launch from a thread other than the main one (autograd's backward thread, a
    server's worker pool) pushes it here and pops it again, since PyCUDA aborts the process when
    a thread ends with a context on its stack."""
    drv = _drv()
    if drv.Context.get_current() is not None:
        yield drv
        return
    _primary_context(drv).push()
    try:
        yield drv
    finally:
        drv.Context.pop()


def device_arch() -> str:
    """``sm_XY`` of the device PyCUDA's context runs on."""
    with bound_context() as drv:
        major, minor = drv.Context.get_device().compute_capability()
    return f"sm_{major}{minor}"


@dataclass
class Operand:
    """A device array seen through what the kernels need: pointer, shape, element strides."""

    name: str
    obj: Any
    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    is_torch: bool


def _check_device(name: str, x: Any) -> None:
    """A torch tensor must be on the current CUDA device (the one PyCUDA's context runs on)."""
    import torch
    if not x.is_cuda:
        raise DeviceError(f"{name} is on {x.device}; pitgen kernels need CUDA tensors "
                          f"(move it with .cuda())")
    current = torch.cuda.current_device()
    if x.device.index != current:
        raise DeviceError(f"{name} is on {x.device} but pitgen runs on cuda:{current} "
                          f"(the current device)")


def as_operand(name: str, x: Any) -> Operand:
    """Accept a CUDA torch tensor or a PyCUDA GPUArray; refuse anything else with the reason."""
    mod = type(x).__module__
    if mod.startswith("torch"):
        import torch
        if not isinstance(x, torch.Tensor):
            raise ShapeError(f"{name}: expected a tensor, got {type(x).__name__}")
        _check_device(name, x)
        return Operand(name, x, x.data_ptr(), tuple(x.shape), tuple(x.stride()),
                       str(x.dtype).replace("torch.", ""), True)
    gpudata = getattr(x, "gpudata", None)
    if gpudata is not None:
        item = x.dtype.itemsize
        return Operand(name, x, int(gpudata), tuple(x.shape),
                       tuple(s // item for s in x.strides), str(x.dtype), False)
    if isinstance(x, np.ndarray):
        raise DeviceError(f"{name} is a NumPy array in host memory; pass a CUDA torch tensor or a "
                          f"pycuda GPUArray (pitgen.execute runs plans on the CPU)")
    raise ShapeError(f"{name}: unsupported array type {type(x).__name__}")


class _Module:
    """One compiled module: its functions, prepared once."""

    def __init__(self, spec: ModuleSpec, arch: str):
        self.spec = spec
        self.source = render(spec)
        self.smem = spec.gemm.smem_bytes(spec.dtype)
        cubin = compile_source(self.source, arch)
        with bound_context() as drv:
            self.module = drv.module_from_buffer(cubin)
            self.gemm = self.module.get_function("pit_gemm")
            self.gemm.prepare("PPPPPPiiiiiiiiii")
            if self.smem > 48 * 1024:
                self.gemm.set_attribute(drv.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                        self.smem)
            self.index = None
            if spec.index is not None:
                self.index = self.module.get_function("pit_build_index")
                self.index.prepare("PiiiiPPPPii")
            self.zero = self.module.get_function("pit_gemm_zero")
            self.zero.prepare("Piiii")
            self.finish = self.module.get_function("pit_gemm_finish")
            self.finish.prepare("PPiiiii")


_MODULES: dict[tuple[str, str], _Module] = {}


def load_module(spec: ModuleSpec) -> _Module:
    """Render, compile (through the on-disk cache) and load ``spec`` once per process."""
    arch = device_arch()
    key = (spec.key, arch)
    if key not in _MODULES:
        _MODULES[key] = _Module(spec, arch)
    return _MODULES[key]


class _Streams:
    """The stream to launch on: torch's current one (via a PyCUDA twin ordered by stream waits).
    Callers hold ``bound_context()`` from enter to leave."""

    def __init__(self):
        self._twins: dict[int, tuple[Any, Any]] = {}

    def enter(self, use_torch: bool, cur: Any = None):
        """(PyCUDA stream, token for leave) for torch's current stream (``cur`` when the caller
        has already asked torch for it)."""
        if not use_torch:
            return None, None
        import torch
        cur = torch.cuda.current_stream() if cur is None else cur
        if cur.cuda_stream == 0:
            return None, None
        if cur.cuda_stream not in self._twins:
            drv = _drv()
            ps = drv.Stream()
            self._twins[cur.cuda_stream] = (ps, torch.cuda.ExternalStream(ps.handle))
        ps, ext = self._twins[cur.cuda_stream]
        ext.wait_stream(cur)
        return ps, (cur, ext)

    @staticmethod
    def leave(token) -> None:
        if token is not None:
            cur, ext = token
            cur.wait_stream(ext)


_STREAMS = _Streams()


class Workspace:
    """Device buffers for one call, from torch's caching allocator when the operands are torch
    tensors (stream-ordered reuse), else from PyCUDA."""

    def __init__(self, like: Operand):
        self.torch = like.is_torch
        self.keep: list[Any] = []

    def alloc(self, shape: tuple[int, ...], dtype: str) -> Any:
        if self.torch:
            import torch
            t = torch.empty(shape, dtype=getattr(torch, dtype), device="cuda")
        else:
            import pycuda.gpuarray as ga
            t = ga.empty(shape, dtype=np.dtype(dtype))
        self.keep.append(t)
        return t

    @staticmethod
    def ptr(x: Any) -> int:
        return x.data_ptr() if hasattr(x, "data_ptr") else int(x.gpudata)


def _align(ptr: int) -> int:
    """Largest power-of-two alignment of a device pointer, capped at 16 bytes."""
    return min(16, ptr & -ptr) if ptr else 16


def signature(ops: dict[str, Operand], out: Operand | None, accumulate: bool,
              mask: Operand | None = None) -> tuple:
    """Everything a launch plan depends on besides the data: shapes, strides, dtypes, array
    kinds and pointer alignment. Calls with equal signatures reuse one :class:`Launcher`."""
    extra = [("out", out), ("mask", mask)]
    parts = [(o.name, o.shape, o.strides, o.dtype, o.is_torch, _align(o.ptr))
             for o in (*ops.values(), *(x for _, x in extra if x is not None))]
    return tuple(parts), accumulate, out is not None, mask is not None


class Launcher:
    """The validated, compiled launch plan of one call signature: problem sizes, module, grids.

    Built once per signature (validation, sympy extents, lowering and the module load are
    all here), so that a call itself only allocates buffers and enqueues launches.
    """

    def __init__(self, op: Operator, form: GemmForm, kind: str, axis: str | None,
                 shape: tuple[int, ...], dtype: str, ops: dict[str, Operand],
                 out: Operand | None, accumulate: bool, schedule: Schedule = Schedule(),
                 vendor_dense: bool = True, mask: Operand | None = None):
        A, B = ops[form.sparse], ops[form.dense]
        if mask is not None:
            if mask.dtype not in ("bool", "uint8"):
                raise ShapeError(f"mask has dtype {mask.dtype}; expected bool or uint8")
            if mask.is_torch != A.is_torch:
                raise ShapeError("mask must be the same kind of array as the operands")
            if any(st < 0 for st in mask.strides):
                raise ShapeError(f"mask has a negative stride {mask.strides}")
        for o in (A, B):
            if o.dtype != dtype:
                raise ShapeError(f"{o.name} has dtype {o.dtype}, the kernel was compiled for {dtype}")
            if any(s < 0 for s in o.strides):
                raise ShapeError(f"{o.name} has a negative stride {o.strides}")
        if A.is_torch != B.is_torch:
            raise ShapeError("mixing torch tensors and GPUArrays in one call is not supported")
        ext = op.extents({o.name: o.shape for o in ops.values()})
        self.M, self.N, self.K = M, N, K = ext[form.m_axis], ext[form.n_axis], ext[form.k_axis]
        self.out_shape = tuple(ext[a] for a in op.output.axes)
        self.form, self.dtype, self.accumulate, self.is_torch = form, dtype, accumulate, A.is_torch
        if out is None:
            if accumulate:
                raise ShapeError("accumulate=True needs out= (the array to add to)")
            sc_out = _contiguous_strides(self.out_shape)
            align_c = 16
        else:
            if out.shape != self.out_shape or out.dtype != dtype:
                raise ShapeError(f"out has shape {out.shape} and dtype {out.dtype}; expected "
                                 f"{self.out_shape} {dtype}")
            if out.is_torch != A.is_torch:
                raise ShapeError("out must be the same kind of array as the operands")
            if not _distinct_strides(out.shape, out.strides):
                raise ShapeError(f"out has overlapping strides {out.strides}: every element "
                                 f"needs its own place")
            sc_out, align_c = out.strides, _align(out.ptr)
        sc = (sc_out[form.c_dims[0]], sc_out[form.c_dims[1]])
        self.layout = Layout(M, N, K, (A.strides[form.a_dims[0]], A.strides[form.a_dims[1]]),
                             (B.strides[form.b_dims[0]], B.strides[form.b_dims[1]]), sc,
                             _align(A.ptr), _align(B.ptr), align_c)
        self.spec = lower(op, form.sparse, kind, axis, shape, dtype, self.layout,
                          accumulate=accumulate, schedule=schedule)
        #: a dense plan on torch tensors runs the vendor GEMM (cuBLAS through torch)
        self.vendor = kind == "dense" and A.is_torch and vendor_dense
        self.mod = load_module(self.spec) if M * N and not self.vendor else None
        g = self.spec.gemm
        self.tk = shape[form.a_dims[1]] if g.a_mode == "rows" else 0
        self.grid_m = (M + g.bm - 1) // g.bm
        ix, lay = self.spec.index, self.layout
        if ix is not None:
            if g.a_mode == "rows":
                self.groups, n_id, n_long = (K + self.tk - 1) // self.tk, M, K
                s_long, s_id, self.cap = lay.sa[1], lay.sa[0], M
            else:
                self.groups, n_id, n_long, s_long, s_id = self.grid_m, K, M, lay.sa[0], lay.sa[1]
                self.cap = K if g.a_mode == "packed" else (K + g.bk * g.ksub - 1) // (g.bk * g.ksub)
            if self.groups > GRID_Y_MAX:
                raise PlanError(f"{self.groups} tile groups exceed the grid limit {GRID_Y_MAX}")
            per_block = 256 if ix.kind == "micro" and ix.strategy == "thread" else 8  # tiles a block tests
            self.index_grid = ((self.cap + per_block - 1) // per_block, self.groups)
            self.index_args = (s_long, s_id, n_long, n_id)
            if mask is not None:  # the mask's strides along the same (long, id) dims
                md = (mask.strides[form.a_dims[0]], mask.strides[form.a_dims[1]])
                self.mask_strides = (md[1], md[0]) if g.a_mode == "rows" else md
            else:
                self.mask_strides = (0, 0)
        self.grid = ((N + g.bn - 1) // g.bn, self.grid_m)
        if g.a_mode == "rows":
            self.grid += ((K + self.tk - 1) // self.tk,)
        if self.grid[1] > GRID_Y_MAX:
            raise PlanError(f"{self.grid[1]} m-tiles exceed the grid limit {GRID_Y_MAX}")
        self.flat = (min((M * N + 255) // 256, 65535), 1)


class GemmCall:
    """One call: the launcher's plan applied to this call's arrays and fresh buffers.

    ``build_index()`` then ``compute()``: both only enqueue work on the stream; nothing waits.
    """

    def __init__(self, launcher: Launcher, ops: dict[str, Operand], out: Any | None,
                 mask: Operand | None = None):
        self.L = L = launcher
        self.mask_ptr = mask.ptr if mask is not None else 0
        self.A, self.B = ops[L.form.sparse], ops[L.form.dense]
        self.ws = Workspace(self.A)
        self.out = out if out is not None else self.ws.alloc(L.out_shape, L.dtype)
        self.c_ptr = Workspace.ptr(self.out)
        self.counts = self.ids = self.pack = None

    def build_index(self, stream) -> None:
        """Zero the counts, then one pass over A' appends every non-zero micro-tile (or block)."""
        L = self.L
        ix = L.spec.index
        if ix is None or L.vendor or L.M * L.N * L.K == 0:
            return
        self.counts = self.ws.alloc((L.groups,), "int32")
        self.ids = self.ws.alloc((L.groups, L.cap), "int32")
        if ix.pack:
            self.pack = self.ws.alloc((L.groups * L.cap * ix.long_extent,), L.dtype)
        _drv().memset_d32_async(Workspace.ptr(self.counts), 0, L.groups, stream)
        L.mod.index.prepared_async_call(
            L.index_grid, (256, 1, 1), stream, self.A.ptr, *L.index_args,
            Workspace.ptr(self.counts), Workspace.ptr(self.ids),
            Workspace.ptr(self.pack) if self.pack is not None else 0,
            self.mask_ptr, *L.mask_strides)

    def compute(self, stream) -> None:
        """The tile kernel over the index (upper-bound grid; empty tiles exit), then SWrite passes."""
        L = self.L
        M, N, K, g, mod, sc = L.M, L.N, L.K, L.spec.gemm, L.mod, L.layout.sc
        if M * N == 0:
            return
        if L.vendor:
            return self._vendor()
        if K == 0:
            if not L.accumulate:
                mod.zero.prepared_async_call(L.flat, (256, 1, 1), stream, self.c_ptr, M, N, *sc)
            return
        f32 = None
        if g.a_mode == "rows":
            if g.c_mode == "atomic":
                f32 = self.ws.alloc((M * N,), "float32")
                _drv().memset_d32_async(Workspace.ptr(f32), 0, M * N, stream)
            elif not L.accumulate:
                mod.zero.prepared_async_call(L.flat, (256, 1, 1), stream, self.c_ptr, M, N, *sc)
        ptr = lambda x: Workspace.ptr(x) if x is not None else 0  # noqa: E731
        lay = L.layout
        mod.gemm.prepared_async_call(
            L.grid, (g.threads, 1, 1), stream,
            ptr(self.pack) if self.pack is not None else self.A.ptr, self.B.ptr, self.c_ptr,
            ptr(f32), ptr(self.counts), ptr(self.ids),
            M, N, K, lay.sa[0], lay.sa[1], lay.sb[0], lay.sb[1], sc[0], sc[1], L.tk,
            shared_size=mod.smem)
        if f32 is not None:
            mod.finish.prepared_async_call(L.flat, (256, 1, 1), stream, self.c_ptr,
                                           Workspace.ptr(f32), M, N, *sc, int(L.accumulate))

    def _vendor(self) -> None:
        """Dense plan on torch tensors: cuBLAS through torch, on torch's current stream."""
        f = self.L.form
        a = self.A.obj.permute(*f.a_dims)
        b = self.B.obj.permute(*f.b_dims)
        c = self.out.permute(*f.c_dims)
        if self.L.accumulate:
            c.addmm_(a, b)
        elif c.is_contiguous():
            import torch
            torch.mm(a, b, out=c)
        else:
            c.copy_(a @ b)

    def run(self) -> Any:
        """build_index + compute on the caller's stream; returns the output array."""
        if self.L.vendor:
            self.compute(None)
            return self.out
        with TorchLaunch(self.A.is_torch) as launch:
            try:
                self.build_index(launch.stream)
                self.compute(launch.stream)
            finally:
                launch.keep(*self.ws.keep)
        return self.out


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def _distinct_strides(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """True when no two in-range indices map to one element (dims sorted by stride nest)."""
    dims = sorted((st, n) for n, st in zip(shape, strides) if n > 1)
    span = 1
    for st, n in dims:
        if st < span:
            return False
        span = st * n
    return True


class Kernels:
    """The named functions of one rendered source, compiled through the on-disk cache, loaded
    once per process and prepared with their PyCUDA argument signatures ("PPii": two pointers,
    two ints). Operators beyond the GEMM module (attention, MoE, formats) launch through this."""

    def __init__(self, source: str, signatures: Mapping[str, str], smem: Mapping[str, int]):
        self.source = source
        cubin = compile_source(source, device_arch())
        self.smem = dict(smem)
        self.functions: dict[str, Any] = {}
        self._smem_limit: dict[str, int] = {}
        with bound_context() as drv:
            self.module = drv.module_from_buffer(cubin)
            for name, sig in signatures.items():
                f = self.module.get_function(name)
                f.prepare(sig)
                self.functions[name] = f
                self._allow_smem(name, self.smem.get(name, 0))

    def _allow_smem(self, name: str, size: int) -> None:
        """Raise the kernel's dynamic shared-memory limit to ``size`` (needed past 48 KiB)."""
        if size > max(48 * 1024, self._smem_limit.get(name, 0)):
            self.functions[name].set_attribute(
                _drv().function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, size)
            self._smem_limit[name] = size

    def launch(self, name: str, grid: tuple[int, ...], block: tuple[int, ...], stream: Any,
               *args: Any, smem: int | None = None) -> None:
        """Enqueue ``name`` on ``stream`` (None: the legacy default stream); nothing waits.
        ``smem`` overrides the configured dynamic shared memory for a size known per launch."""
        if 0 in grid:
            return
        size = self.smem.get(name, 0) if smem is None else smem
        self._allow_smem(name, size)
        self.functions[name].prepared_async_call(grid, block, stream, *args, shared_size=size)


_KERNELS: dict[tuple[str, str], Kernels] = {}
_CONFIGS: dict[tuple[str, str, str], Kernels] = {}


def load_kernels(template: str, signatures: Mapping[str, str],
                 smem: Mapping[str, int] | None = None, **ctx: Any) -> Kernels:
    """``template`` rendered with ``ctx``, compiled and loaded once per process. A configuration
    seen before returns at once (no rendering: it costs milliseconds, and operators call this on
    every launch); configurations that render to the same source share one module. A hit does
    not ask the driver for the device again: these operators assume one GPU architecture per
    process."""
    config = (template, repr(sorted(ctx.items())), repr(sorted((smem or {}).items())))
    hit = _CONFIGS.get(config)
    if hit is not None:
        return hit
    source = render_template(template, **ctx)
    key = (hashlib.sha256(source.encode()).hexdigest(), device_arch())
    if key not in _KERNELS:
        _KERNELS[key] = Kernels(source, signatures, smem or {})
    _CONFIGS[config] = _KERNELS[key]
    return _KERNELS[key]


class TorchLaunch:
    """Launch context on torch's current stream: ``stream`` for PyCUDA launches (a twin ordered
    after torch's stream, and torch's stream after it on exit, GPU-side), ``keep(t)`` for
    tensors the launches use so the caching allocator does not recycle them too early. Works
    from any thread (``bound_context``). ``use_torch=False`` (PyCUDA GPUArray operands): the
    legacy default stream, nothing to order or keep."""

    def __init__(self, use_torch: bool = True) -> None:
        self._bound = ExitStack()
        self._bound.enter_context(bound_context())
        try:
            #: torch's current stream, which the launches are ordered with (None: no torch)
            self.torch_stream = None
            if use_torch:
                import torch
                self.torch_stream = torch.cuda.current_stream()
            self.stream, self._token = _STREAMS.enter(use_torch, self.torch_stream)
        except BaseException:
            self._bound.close()
            raise
        self._keep: list[Any] = []

    def keep(self, *tensors: Any) -> None:
        self._keep.extend(tensors)

    def __enter__(self) -> TorchLaunch:
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            _STREAMS.leave(self._token)
            if self._token is not None:
                for t in self._keep:
                    t.record_stream(self._token[1])
        finally:
            self._bound.close()


def stream_counters(cache: dict[int, Any], stream: Any, size: int, device: Any) -> Any:
    """At least ``size`` int32 counters for launches on torch ``stream`` whose kernels leave them
    zero again: zeroed once per stream in ``cache`` (and again when a launch needs more), so
    launches on one stream, which run in order, share them and none has to clear them first."""
    import torch
    buf = cache.get(stream.cuda_stream)
    if buf is None or buf.numel() < size:
        buf = cache[stream.cuda_stream] = torch.zeros(max(size, 1), dtype=torch.int32,
                                                      device=device)
    return buf


def check_tensor(name: str, x: Any, dtypes: tuple[str, ...], ndim: int | None = None,
                 shape: tuple[int | None, ...] | None = None, contiguous: bool = True) -> Any:
    """Validate a CUDA torch tensor operand, raising the pitgen error that names what is wrong
    (type, device, dtype, rank, shape, layout); returns ``x``."""
    import torch
    if not isinstance(x, torch.Tensor):
        raise ShapeError(f"{name}: expected a torch tensor, got {type(x).__name__}")
    _check_device(name, x)
    dt = str(x.dtype).replace("torch.", "")
    if dt not in dtypes:
        raise ShapeError(f"{name} has dtype {dt}; expected {' or '.join(dtypes)}")
    if ndim is not None and x.dim() != ndim:
        raise ShapeError(f"{name} has {x.dim()} dims {tuple(x.shape)}; expected {ndim}")
    if shape is not None:
        for i, (got, want) in enumerate(zip(x.shape, shape)):
            if want is not None and got != want:
                raise ShapeError(f"{name} has shape {tuple(x.shape)}; dim {i} must be {want}")
    if contiguous and not x.is_contiguous():
        raise ShapeError(f"{name} is not contiguous (strides {tuple(x.stride())}); "
                         f"pass {name}.contiguous()")
    return x
