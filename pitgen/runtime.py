"""Runtime: load compiled modules and launch their kernels, nothing else.

Kernels launch on PyTorch tensors or PyCUDA GPUArrays, in the caller's stream, with no host
synchronisation. PyCUDA shares PyTorch's (primary) context: ``pycuda.autoprimaryctx`` keeps it
current in the main thread, and any other thread pushes it for the length of a call
(``bound_context``), so operators run from autograd's backward thread or a worker pool alike.
When the current torch stream is not the legacy default stream, launches go to a PyCUDA stream
that is ordered after the torch stream and before its later work with stream waits (GPU-side).

What to load comes from :mod:`pitgen.opspec` (rendered source -> :func:`load`); the module
cache here is keyed by the cubin's source, so configurations that render alike share a module.
"""
from __future__ import annotations

import hashlib
import sys
import threading
from contextlib import ExitStack, contextmanager
from typing import Any, Iterator, Mapping

from . import cache
from .compiler import compile_source
from .errors import DeviceError

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


def device_sms() -> int:
    """Multiprocessors of the device PyCUDA's context runs on (persistent grids: one CTA each)."""
    with bound_context() as drv:
        dev = drv.Context.get_device()
        return dev.get_attribute(drv.device_attribute.MULTIPROCESSOR_COUNT)


def compile_target(arch: str) -> str:
    """The nvcc target of a device: Hopper builds as sm_90a, so that its modules may use
    wgmma and setmaxnreg (the code runs on exactly that chip, as every cubin here does)."""
    return "sm_90a" if arch == "sm_90" else arch


#: CUtensorMapDataType of each element type TMA moves here.
_TMA_DTYPES = {"float16": 6, "bfloat16": 9}
_TMA_SWIZZLE_128B, _TMA_L2_256B = 3, 3


@cache.lru("runtime.tensor_maps", 256)
def tensor_map(ptr: int, dtype: str, dims: tuple[int, int], row_stride: int,
               box: tuple[int, int]) -> bytes:
    """A 2-D TMA descriptor (CUtensorMap, 128 bytes, passed by value to a kernel) of the
    matrix at ``ptr``: ``dims`` (inner, outer) elements, ``row_stride`` elements between outer
    rows, ``box`` (inner, outer) elements per copy, 128-byte swizzle, zeros outside. Encoded
    on the host by the driver (no device work); remembered per argument tuple."""
    import ctypes
    out = ctypes.create_string_buffer(128)
    u64, u32 = ctypes.c_uint64 * 2, ctypes.c_uint32 * 2
    rc = _libcuda().cuTensorMapEncodeTiled(
        out, _TMA_DTYPES[dtype], 2, ctypes.c_void_p(ptr), u64(*dims),
        (ctypes.c_uint64 * 1)(row_stride * 2), u32(*box), u32(1, 1), 0, _TMA_SWIZZLE_128B,
        _TMA_L2_256B, 0)
    if rc != 0:
        raise DeviceError(f"cuTensorMapEncodeTiled failed (CUresult {rc}) for a {dtype} "
                          f"matrix {dims} with row stride {row_stride} and box {box}")
    return out.raw


_LIBCUDA: list[Any] = []


def _libcuda() -> Any:
    """The driver library PyCUDA runs on, for the one entry point it does not wrap."""
    if not _LIBCUDA:
        import ctypes
        _drv()
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuTensorMapEncodeTiled.restype = ctypes.c_int
        _LIBCUDA.append(lib)
    return _LIBCUDA[0]


class Module:
    """One loaded cubin: its kernels, each prepared with its PyCUDA argument signature ("PPii":
    two pointers, two ints) on first use, and its dynamic shared-memory limit raised as needed.

    Signature letter ``M`` is a 128-byte by-value TMA descriptor (``__grid_constant__
    CUtensorMap``). Such a parameter is 64-byte aligned, and PyCUDA's packed parameter buffer
    cannot express that alignment, so those kernels launch through the driver's per-parameter
    interface (:class:`_DriverKernel`) on the same context and stream."""

    def __init__(self, cubin: bytes, signatures: Mapping[str, str]):
        self.signatures = dict(signatures)
        self._functions: dict[str, Any] = {}
        self._smem_limit: dict[str, int] = {}
        self._cubin = cubin
        self._raw: _DriverModule | None = None
        with bound_context() as drv:
            self.module = drv.module_from_buffer(cubin)

    def function(self, name: str) -> Any:
        """The prepared kernel ``name`` (a PyCUDA Function, or a _DriverKernel)."""
        f = self._functions.get(name)
        if f is None:
            sig = self.signatures[name]
            if "M" in sig:
                if self._raw is None:
                    self._raw = _DriverModule(self._cubin)
                f = _DriverKernel(self._raw, name, sig)
            else:
                f = self.module.get_function(name)
                f.prepare(sig)
            self._functions[name] = f
        return f

    def launch(self, name: str, grid: tuple[int, ...], block: tuple[int, ...], stream: Any,
               *args: Any, smem: int = 0) -> None:
        """Enqueue ``name`` on ``stream`` (None: the legacy default stream) with ``smem`` bytes
        of dynamic shared memory; an empty grid launches nothing. Nothing waits."""
        if 0 in grid:
            return
        f = self.function(name)
        if smem > max(48 * 1024, self._smem_limit.get(name, 0)):
            f.set_attribute(_drv().function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
            self._smem_limit[name] = smem
        f.prepared_async_call(grid, block, stream, *args, shared_size=smem)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise DeviceError(f"{what} failed (CUresult {rc})")


class _DriverModule:
    """The cubin loaded a second time through the driver API itself (for kernels PyCUDA cannot
    pass arguments to); unloaded with the Module that owns it."""

    def __init__(self, cubin: bytes):
        import ctypes
        self._lib = _libcuda()
        self._keep = ctypes.create_string_buffer(cubin, len(cubin))
        handle = ctypes.c_void_p()
        with bound_context():
            _check(self._lib.cuModuleLoadData(ctypes.byref(handle), self._keep), "cuModuleLoadData")
        self.handle = handle

    def __del__(self) -> None:
        if self.handle:
            self._lib.cuModuleUnload(self.handle)


class _DriverKernel:
    """One kernel of a _DriverModule, launched with cuLaunchKernel's per-parameter array: the
    driver places each argument at the offset the cubin declares (``M``: 128 bytes, ``P``:
    pointer, ``i``: int32)."""

    def __init__(self, module: _DriverModule, name: str, signature: str):
        import ctypes
        self._module, self._lib = module, module._lib
        self._types = [{"P": ctypes.c_uint64, "i": ctypes.c_int32}.get(code) for code in signature]
        self.handle = ctypes.c_void_p()
        _check(self._lib.cuModuleGetFunction(ctypes.byref(self.handle), module.handle,
                                             name.encode()), f"cuModuleGetFunction({name})")

    def set_attribute(self, attribute: Any, value: int) -> None:
        _check(self._lib.cuFuncSetAttribute(self.handle, int(attribute), value),
               "cuFuncSetAttribute")

    def prepared_async_call(self, grid: tuple[int, ...], block: tuple[int, ...], stream: Any,
                            *args: Any, shared_size: int = 0) -> None:
        import ctypes
        values = [kind(a) if kind else ctypes.create_string_buffer(a, 128)  # M: 128 bytes
                  for kind, a in zip(self._types, args)]
        params = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
        g, b = (*grid, 1, 1)[:3], (*block, 1, 1)[:3]
        _check(self._lib.cuLaunchKernel(
            self.handle, *g, *b, shared_size,
            ctypes.c_void_p(stream.handle if stream is not None else 0), params, None),
            "cuLaunchKernel")


def _finish_work() -> None:
    """Wait for the device before loaded modules are dropped: unloading one under a queued or
    running launch is undefined (pitgen.cache.clear)."""
    if _DRV:
        with bound_context() as drv:
            drv.Context.synchronize()


_MODULES = cache.memo("runtime.modules", before_clear=_finish_work)


def load(source: str, signatures: Mapping[str, str]) -> Module:
    """The module of ``source`` for this device, compiled (through the on-disk cache) and loaded
    once per process."""
    arch = device_arch()
    key = (hashlib.sha256(source.encode()).hexdigest(), arch)
    mod = _MODULES.get(key)
    if mod is None:
        mod = _MODULES[key] = Module(compile_source(source, compile_target(arch)), signatures)
    return mod


def memset_d32(ptr: int, value: int, count: int, stream: Any) -> None:
    """Enqueue a fill of ``count`` 32-bit words at ``ptr`` with ``value``."""
    _drv().memset_d32_async(ptr, value, count, stream)


class _Streams:
    """The stream to launch on: torch's current one (via a PyCUDA twin ordered by stream waits).
    Callers hold ``bound_context()`` from enter to leave."""

    def __init__(self):
        #: torch stream handle -> (PyCUDA stream, torch ExternalStream of it). Not a cache:
        #: tensors are recorded on the twins, so they live as long as the process.
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


def stream_counters(by_stream: dict[int, Any], stream: Any, size: int, device: Any) -> Any:
    """At least ``size`` int32 counters for launches on torch ``stream`` whose kernels leave them
    zero again: zeroed once per stream in ``by_stream`` (and again when a launch needs more), so
    launches on one stream, which run in order, share them and none has to clear them first."""
    import torch
    buf = by_stream.get(stream.cuda_stream)
    if buf is None or buf.numel() < size:
        buf = by_stream[stream.cuda_stream] = torch.zeros(max(size, 1), dtype=torch.int32,
                                                          device=device)
    return buf


