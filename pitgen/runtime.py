"""Runtime: compiled modules loaded through PyCUDA and launched on PyTorch tensors or PyCUDA
GPUArrays, in the caller's stream, with no host synchronisation between index build and compute.

PyCUDA shares PyTorch's (primary) context via ``pycuda.autoprimaryctx``. When the current torch
stream is not the legacy default stream, launches go to a PyCUDA stream that is ordered after
the torch stream and before its later work with stream waits (GPU-side, no host sync).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .compiler import compile_source
from .errors import DeviceError, PlanError, ShapeError
from .expr import Operator
from .lower import DTYPES, GemmForm, Layout, ModuleSpec, lower
from .render import render

GRID_Y_MAX = 65535


def _drv():
    """pycuda.driver with PyTorch's primary context current; DeviceError when unusable."""
    try:
        try:
            import torch
            if torch.cuda.is_available():
                torch.cuda.init()
        except ImportError:
            pass
        import pycuda.autoprimaryctx  # noqa: F401  (retains and pushes the primary context)
        import pycuda.driver as drv
    except ImportError as e:
        raise DeviceError(f"pycuda is not installed ({e}); pip install 'pitgen[cuda]'") from None
    except Exception as e:  # driver missing, no device
        raise DeviceError(f"no usable CUDA device: {e}") from None
    return drv


def device_arch() -> str:
    """``sm_XY`` of the device PyCUDA's context runs on."""
    drv = _drv()
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


_TORCH_DTYPES = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32"}


def as_operand(name: str, x: Any) -> Operand:
    """Accept a CUDA torch tensor or a PyCUDA GPUArray; refuse anything else with the reason."""
    mod = type(x).__module__
    if mod.startswith("torch"):
        import torch
        if not isinstance(x, torch.Tensor):
            raise ShapeError(f"{name}: expected a tensor, got {type(x).__name__}")
        if not x.is_cuda:
            raise DeviceError(f"{name} is on {x.device}; pitgen kernels need CUDA tensors "
                              f"(move it with .cuda())")
        if x.device.index != torch.cuda.current_device():
            raise DeviceError(f"{name} is on {x.device} but pitgen runs on cuda:"
                              f"{torch.cuda.current_device()} (the current device)")
        dt = str(x.dtype).replace("torch.", "")
        return Operand(name, x, x.data_ptr(), tuple(x.shape), tuple(x.stride()),
                       _TORCH_DTYPES.get(dt, dt), True)
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
        drv = _drv()
        self.spec = spec
        self.source = render(spec)
        self.module = drv.module_from_buffer(compile_source(self.source, arch))
        self.gemm = self.module.get_function("pit_gemm")
        self.gemm.prepare("PPPPPPiiiiiiiiii")
        self.smem = spec.gemm.smem_bytes(spec.dtype)
        if self.smem > 48 * 1024:
            self.gemm.set_attribute(drv.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, self.smem)
        self.index = None
        if spec.index is not None:
            self.index = self.module.get_function("pit_build_index")
            self.index.prepare("PiiiiPPP")
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
    """The stream to launch on: torch's current one (via a PyCUDA twin ordered by stream waits)."""

    def __init__(self):
        self._twins: dict[int, tuple[Any, Any]] = {}

    def enter(self, use_torch: bool):
        if not use_torch:
            return None, None
        import torch
        cur = torch.cuda.current_stream()
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


class GemmCall:
    """One call of a GEMM-form plan: validated operands, the module, and its launches.

    ``build_index()`` then ``compute()``: both only enqueue work on the stream; nothing waits.
    """

    def __init__(self, op: Operator, form: GemmForm, kind: str, axis: str | None,
                 shape: tuple[int, ...], dtype: str, ops: dict[str, Operand], out: Any | None,
                 accumulate: bool, bn: int = 128, bk: int | None = None):
        A, B = ops[form.sparse], ops[form.dense]
        for o in (A, B):
            if o.dtype != dtype:
                raise ShapeError(f"{o.name} has dtype {o.dtype}, the kernel was compiled for {dtype}")
            if any(s < 0 for s in o.strides):
                raise ShapeError(f"{o.name} has a negative stride {o.strides}")
        if A.is_torch != B.is_torch:
            raise ShapeError("mixing torch tensors and GPUArrays in one call is not supported")
        ext = op.extents({o.name: o.shape for o in ops.values()})
        self.M, self.N, self.K = M, N, K = ext[form.m_axis], ext[form.n_axis], ext[form.k_axis]
        out_shape = tuple(ext[a] for a in op.output.axes)
        self.ws = Workspace(A)
        if out is None:
            if accumulate:
                raise ShapeError("accumulate=True needs out= (the array to add to)")
            out = self.ws.alloc(out_shape, dtype)
        C = as_operand(op.output.tensor, out)
        if C.shape != out_shape or C.dtype != dtype:
            raise ShapeError(f"out has shape {C.shape} and dtype {C.dtype}; expected {out_shape} {dtype}")
        if C.is_torch != A.is_torch:
            raise ShapeError("out must be the same kind of array as the operands")
        if not _distinct_strides(C.shape, C.strides):
            raise ShapeError(f"out has overlapping strides {C.strides}: every element needs its own place")
        sc = (C.strides[form.c_dims[0]], C.strides[form.c_dims[1]])
        align = lambda p: min(16, p & -p) if p else 16  # noqa: E731  (pointer alignment, bytes)
        self.layout = Layout(M, N, K, (A.strides[form.a_dims[0]], A.strides[form.a_dims[1]]),
                             (B.strides[form.b_dims[0]], B.strides[form.b_dims[1]]), sc,
                             align(A.ptr), align(B.ptr))
        self.spec = lower(op, form.sparse, kind, axis, shape, dtype, self.layout, bn=bn, bk=bk,
                          accumulate=accumulate)
        self.A, self.B, self.C, self.out = A, B, C, out
        self.accumulate = accumulate
        self.tk = shape[form.a_dims[1]] if self.spec.gemm.a_mode == "rows" else 0
        self.counts = self.ids = self.pack = None
        self.mod = load_module(self.spec) if M * N else None

    @property
    def grid_m(self) -> int:
        return (self.M + self.spec.gemm.bm - 1) // self.spec.gemm.bm

    def build_index(self, stream) -> None:
        """Zero the counts, then one pass over A' appends every non-zero micro-tile (or block)."""
        ix, g, lay = self.spec.index, self.spec.gemm, self.layout
        if ix is None or self.M * self.N * self.K == 0:
            return
        if g.a_mode == "rows":
            groups, n_id, n_long, s_long, s_id = (self.K + self.tk - 1) // self.tk, self.M, self.K, lay.sa[1], lay.sa[0]
            cap = self.M
        else:
            groups, n_id, n_long, s_long, s_id = self.grid_m, self.K, self.M, lay.sa[0], lay.sa[1]
            cap = self.K if g.a_mode == "packed" else (self.K + g.bk * g.ksub - 1) // (g.bk * g.ksub)
        if groups > GRID_Y_MAX:
            raise PlanError(f"{groups} tile groups exceed the grid limit {GRID_Y_MAX}")
        self.counts = self.ws.alloc((groups,), "int32")
        self.ids = self.ws.alloc((groups, cap), "int32")
        if ix.pack:
            self.pack = self.ws.alloc((groups * cap * ix.long_extent,), self.spec.dtype)
        _drv().memset_d32_async(Workspace.ptr(self.counts), 0, groups, stream)
        per_block = 256 if ix.kind == "micro" and ix.strategy == "thread" else 8  # tiles a block tests
        self.mod.index.prepared_async_call(
            ((cap + per_block - 1) // per_block, groups), (256, 1, 1), stream,
            self.A.ptr, s_long, s_id, n_long, n_id, Workspace.ptr(self.counts),
            Workspace.ptr(self.ids), Workspace.ptr(self.pack) if self.pack is not None else 0)

    def compute(self, stream) -> None:
        """The tile kernel over the index (upper-bound grid; empty tiles exit), then SWrite passes."""
        M, N, K, g, mod, sc = self.M, self.N, self.K, self.spec.gemm, self.mod, self.layout.sc
        if M * N == 0:
            return
        flat = (min((M * N + 255) // 256, 65535), 1)
        if K == 0:
            if not self.accumulate:
                mod.zero.prepared_async_call(flat, (256, 1, 1), stream, self.C.ptr, M, N, *sc)
            return
        grid = ((N + g.bn - 1) // g.bn, self.grid_m)
        f32 = None
        if g.a_mode == "rows":
            grid = grid + ((K + self.tk - 1) // self.tk,)
            if g.c_mode == "atomic":
                f32 = self.ws.alloc((M * N,), "float32")
                _drv().memset_d32_async(Workspace.ptr(f32), 0, M * N, stream)
            elif not self.accumulate:
                mod.zero.prepared_async_call(flat, (256, 1, 1), stream, self.C.ptr, M, N, *sc)
        if grid[1] > GRID_Y_MAX:
            raise PlanError(f"{grid[1]} m-tiles exceed the grid limit {GRID_Y_MAX}")
        ptr = lambda x: Workspace.ptr(x) if x is not None else 0  # noqa: E731
        lay = self.layout
        mod.gemm.prepared_async_call(
            grid, (g.threads, 1, 1), stream,
            ptr(self.pack) if self.pack is not None else self.A.ptr, self.B.ptr, self.C.ptr,
            ptr(f32), ptr(self.counts), ptr(self.ids),
            M, N, K, lay.sa[0], lay.sa[1], lay.sb[0], lay.sb[1], sc[0], sc[1], self.tk,
            shared_size=mod.smem)
        if f32 is not None:
            mod.finish.prepared_async_call(flat, (256, 1, 1), stream, self.C.ptr,
                                           Workspace.ptr(f32), M, N, *sc, int(self.accumulate))

    def run(self) -> Any:
        """build_index + compute on the caller's stream; returns the output array."""
        stream, token = _STREAMS.enter(self.A.is_torch)
        try:
            self.build_index(stream)
            self.compute(stream)
        finally:
            _STREAMS.leave(token)
            if token is not None:  # buffers used on the twin stream live until it is done
                for t in self.ws.keep:
                    t.record_stream(token[1])
        return self.out


def _distinct_strides(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """True when no two in-range indices map to one element (dims sorted by stride nest)."""
    dims = sorted((st, n) for n, st in zip(shape, strides) if n > 1)
    span = 1
    for st, n in dims:
        if st < span:
            return False
        span = st * n
    return True
