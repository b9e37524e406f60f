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


def run_gemm(op: Operator, form: GemmForm, kind: str, axis: str | None, shape: tuple[int, ...],
             dtype: str, ops: dict[str, Operand], out: Any | None, accumulate: bool,
             bn: int = 128, bk: int | None = None) -> Any:
    """Index build -> tile kernel -> SWrite passes for one call; returns the output array."""
    drv = _drv()
    A, B = ops[form.sparse], ops[form.dense]
    for o in (A, B):
        if o.dtype != dtype:
            raise ShapeError(f"{o.name} has dtype {o.dtype}, the kernel was compiled for {dtype}")
        if any(s < 0 for s in o.strides):
            raise ShapeError(f"{o.name} has a negative stride {o.strides}")
    ext = op.extents({o.name: o.shape for o in ops.values()})
    M, N, K = ext[form.m_axis], ext[form.n_axis], ext[form.k_axis]
    out_shape = tuple(ext[a] for a in op.output.axes)
    ws = Workspace(A)
    if out is None:
        if accumulate:
            raise ShapeError("accumulate=True needs out= (the array to add to)")
        out = ws.alloc(out_shape, dtype)
    C = as_operand(op.output.tensor, out)
    if C.shape != out_shape or C.dtype != dtype:
        raise ShapeError(f"out has shape {C.shape} and dtype {C.dtype}; expected {out_shape} {dtype}")
    if C.obj is not out or (C.is_torch != A.is_torch):
        raise ShapeError("out must be the same kind of array as the operands")
    sc = (C.strides[form.c_dims[0]], C.strides[form.c_dims[1]])
    if M * N and not _distinct_strides(C.shape, C.strides):
        raise ShapeError(f"out has overlapping strides {C.strides}: every element needs its own place")
    if M * N == 0:
        return out
    al = lambda p: p & -p if p else 16  # noqa: E731  (largest power of two dividing the pointer)
    layout = Layout(M, N, K, (A.strides[form.a_dims[0]], A.strides[form.a_dims[1]]),
                    (B.strides[form.b_dims[0]], B.strides[form.b_dims[1]]), sc,
                    min(16, al(A.ptr)), min(16, al(B.ptr)))
    spec = lower(op, form.sparse, kind, axis, shape, dtype, layout, bn=bn, bk=bk,
                 accumulate=accumulate)
    mod = load_module(spec)
    g = spec.gemm
    stream, token = _STREAMS.enter(A.is_torch)
    try:
        if K == 0:
            if not accumulate:
                mod.zero.prepared_async_call(((M * N + 255) // 256, 1), (256, 1, 1), stream,
                                             C.ptr, M, N, *sc)
            return out
        counts = ids = pack = f32 = None
        ix = spec.index
        grid_m = (M + g.bm - 1) // g.bm
        if ix is not None:
            if g.a_mode == "packed":
                groups, n_id, n_long, s_long, s_id = grid_m, K, M, layout.sa[0], layout.sa[1]
                cap = K
            elif g.a_mode == "rows":
                tk = shape[form.a_dims[1]]
                groups, n_id, n_long, s_long, s_id = (K + tk - 1) // tk, M, K, layout.sa[1], layout.sa[0]
                cap = M
            else:
                groups, n_id, n_long, s_long, s_id = grid_m, K, M, layout.sa[0], layout.sa[1]
                cap = (K + g.bk - 1) // g.bk
            if groups > GRID_Y_MAX:
                raise PlanError(f"{groups} tile groups exceed the grid limit {GRID_Y_MAX}")
            counts = ws.alloc((groups,), "int32")
            ids = ws.alloc((groups * cap,), "int32")
            if ix.pack:
                pack = ws.alloc((groups * cap * ix.long_extent,), dtype)
            drv.memset_d32_async(Workspace.ptr(counts), 0, groups, stream)
            per_block = 256 if ix.kind == "micro" and ix.strategy == "thread" else 8  # tiles
            mod.index.prepared_async_call(
                ((cap + per_block - 1) // per_block, groups), (256, 1, 1), stream,
                A.ptr, s_long, s_id, n_long, n_id, Workspace.ptr(counts), Workspace.ptr(ids),
                Workspace.ptr(pack) if pack is not None else 0)
        grid = ((N + g.bn - 1) // g.bn, grid_m)
        tk_arg = 0
        if g.a_mode == "rows":
            tk_arg = shape[form.a_dims[1]]
            grid = grid + ((K + tk_arg - 1) // tk_arg,)
            if g.c_mode == "atomic":
                f32 = ws.alloc((M * N,), "float32")
                drv.memset_d32_async(Workspace.ptr(f32), 0, M * N, stream)
            elif not accumulate:
                mod.zero.prepared_async_call((min((M * N + 255) // 256, 65535), 1), (256, 1, 1),
                                             stream, C.ptr, M, N, *sc)
        if grid[1] > GRID_Y_MAX:
            raise PlanError(f"{grid[1]} m-tiles exceed the grid limit {GRID_Y_MAX}")
        mod.gemm.prepared_async_call(
            grid, (g.threads, 1, 1), stream,
            Workspace.ptr(pack) if pack is not None else A.ptr, B.ptr, C.ptr,
            Workspace.ptr(f32) if f32 is not None else 0,
            Workspace.ptr(counts) if counts is not None else 0,
            Workspace.ptr(ids) if ids is not None else 0,
            M, N, K, layout.sa[0], layout.sa[1], layout.sb[0], layout.sb[1], sc[0], sc[1], tk_arg,
            shared_size=mod.smem)
        if f32 is not None:
            mod.finish.prepared_async_call((min((M * N + 255) // 256, 65535), 1), (256, 1, 1),
                                           stream, C.ptr, Workspace.ptr(f32), M, N, *sc,
                                           int(accumulate))
    finally:
        _STREAMS.leave(token)
        if A.is_torch and token is not None:
            import torch
            for t in ws.keep:  # buffers were used on the twin stream: keep them until it is done
                t.record_stream(token[1])
    return out


def _distinct_strides(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """True when no two in-range indices map to one element (dims sorted by stride nest)."""
    dims = sorted((st, n) for n, st in zip(shape, strides) if n > 1)
    span = 1
    for st, n in dims:
        if st < span:
            return False
        span = st * n
    return True
