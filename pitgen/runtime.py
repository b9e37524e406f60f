"""Runtime: load compiled modules and launch their kernels, nothing else.

Kernels launch on PyTorch tensors or PyCUDA GPUArrays, on torch's current stream, with no host
synchronisation. PyCUDA shares PyTorch's (primary) contexts: ``pycuda.autoprimaryctx`` keeps the
first device's current in the main thread, and a launch elsewhere (another thread, or another
current device: torch's ``torch.cuda.device``) pushes the current device's for the length of a
call (``bound_context``), so operators run from autograd's backward thread, a worker pool or on
any device alike. Loaded modules belong to one device's context: their cache is keyed by the
device index (:func:`device_index`).
Modules load and kernels launch through the driver API itself (``cuLaunchKernel`` on torch's
CUstream handle, arguments packed once per call): a steady-state launch costs a few
microseconds of host time, and no stream or event is created or waited on per call.

What to load comes from :mod:`pitgen.opspec` (rendered source -> :func:`load`); the module
cache here is keyed by the cubin's source, so configurations that render alike share a module.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Mapping

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
        current = None
        try:
            import torch
            if torch.cuda.is_available():
                torch.cuda.init()
                current = torch.cuda.current_device()
        except ImportError:
            pass
        import pycuda.driver as drv
        if main:
            import pycuda.autoprimaryctx  # noqa: F401  (retains and pushes the primary context)
            if current:  # its push made the first device's context current: torch's back
                torch._C._cuda_setDevice(current)
        else:
            drv.init()
            _primary_context(drv, current or 0)
    except ImportError as e:
        raise DeviceError(f"pycuda is not installed ({e}); pip install 'pitgen[cuda]'") from None
    except Exception as e:  # driver missing, no device
        raise DeviceError(f"no usable CUDA device: {e}") from None
    _DRV[:] = [drv]
    return drv


#: device index -> its primary context, retained here (the one PyTorch uses on that device)
_PRIMARY: dict[int, Any] = {}
#: [torch._C._cuda_getDevice, or None without a usable torch]
_GET_DEVICE: list[Any] = []


def device_index() -> int:
    """The device launches go to: torch's current device (``torch.cuda.device`` or
    ``set_device`` moves it); 0 without torch (PyCUDA GPUArray callers run on the first
    device's context). One call into torch: operators key their loaded modules by it."""
    if not _GET_DEVICE:
        try:
            import torch
            _GET_DEVICE.append(torch._C._cuda_getDevice if torch.cuda.is_available() else None)
        except ImportError:
            _GET_DEVICE.append(None)
    get = _GET_DEVICE[0]
    return get() if get is not None else 0


#: PCI bus id -> driver ordinal (the ordering torch's device indices use)
_ORDINALS: dict[str, int] = {}


def _ordinal(drv: Any, device: Any) -> int:
    """The driver ordinal of a pycuda Device."""
    if not _ORDINALS:
        _ORDINALS.update({drv.Device(i).pci_bus_id(): i for i in range(drv.Device.count())})
    return _ORDINALS[device.pci_bus_id()]


def _primary_context(drv: Any, dev: int | None = None) -> Any:
    """The primary context of device ``dev`` (default: the current one), as PyTorch uses it:
    autoprimaryctx's for its device, else retained here once per device (the same CUcontext,
    so modules loaded under either work in both)."""
    dev = device_index() if dev is None else dev
    ctx = _PRIMARY.get(dev)
    if ctx is None:
        auto = sys.modules.get("pycuda.autoprimaryctx")
        if auto is not None and _ordinal(drv, auto.device) == dev:
            ctx = auto.context
        else:
            ctx = drv.Device(dev).retain_primary_context()
        _PRIMARY[dev] = ctx
    return ctx


#: [the device index of autoprimaryctx's context, the main thread's for good]
_MAIN_DEVICE: list[int] = []


def _context_is_current() -> bool:
    """True when the current device's context is current in this thread for good (the main
    thread, once ``pycuda.autoprimaryctx`` made its device's so, while that device is torch's
    current one): a launch there needs no push."""
    if not (_DRV and "pycuda.autoprimaryctx" in sys.modules
            and threading.current_thread() is threading.main_thread()):
        return False
    if not _MAIN_DEVICE:
        _MAIN_DEVICE.append(_ordinal(_DRV[0], sys.modules["pycuda.autoprimaryctx"].device))
    return device_index() == _MAIN_DEVICE[0]


@contextmanager
def bound_context() -> Iterator[Any]:
    """pycuda.driver with the current device's primary context current in this thread while
    the block runs: a launch from a thread other than the main one (autograd's backward thread,
    a server's worker pool), or on another device than the main thread's context, pushes it
    here and pops it again, since PyCUDA aborts the process when a thread ends with a context
    on its stack."""
    drv = _drv()
    dev = device_index()
    ctx = _primary_context(drv, dev)
    if drv.Context.get_current() is not None and _ordinal(drv, drv.Context.get_device()) == dev:
        yield drv
        return
    ctx.push()
    try:
        yield drv
    finally:
        drv.Context.pop()


#: device index -> (``sm_XY``, multiprocessors): asked of the driver once per device
_DEVICE_FACTS: dict[int, tuple[str, int]] = {}


def _device_facts() -> tuple[str, int]:
    """(arch, SM count) of the current device, read once (a context push and two driver
    queries, which launch paths would otherwise pay on every call)."""
    dev = device_index()
    facts = _DEVICE_FACTS.get(dev)
    if facts is None:
        with bound_context() as drv:
            d = drv.Context.get_device()
            major, minor = d.compute_capability()
            facts = (f"sm_{major}{minor}", d.get_attribute(drv.device_attribute.MULTIPROCESSOR_COUNT))
        _DEVICE_FACTS[dev] = facts
    return facts


def device_arch() -> str:
    """``sm_XY`` of the current device (the one PyCUDA's context runs on)."""
    return _device_facts()[0]


def device_sms() -> int:
    """Multiprocessors of the current device (persistent grids: one CTA each)."""
    return _device_facts()[1]


def compile_target(arch: str) -> str:
    """The nvcc target of a device: Hopper builds as sm_90a, so that its modules may use
    wgmma and setmaxnreg (the code runs on exactly that chip, as every cubin here does)."""
    return "sm_90a" if arch == "sm_90" else arch


#: CUtensorMapDataType of each element type TMA moves here.
_TMA_DTYPES = {"float16": 6, "bfloat16": 9}
_TMA_SWIZZLE_128B, _TMA_L2_256B = 3, 3


@cache.lru("runtime.tensor_maps", 256)
def tensor_map(ptr: int, dtype: str, dims: tuple[int, ...], strides: int | tuple[int, ...],
               box: tuple[int, ...]) -> bytes:
    """A 2- or 3-D TMA descriptor (CUtensorMap, 128 bytes, passed by value to a kernel) of the
    array at ``ptr``: ``dims`` elements, innermost first; ``strides`` the elements between
    consecutive indices of each outer dim (an int for 2-D); ``box`` elements per copy, 128-byte
    swizzle, zeros outside. Encoded on the host by the driver (no device work); remembered per
    argument tuple."""
    strides = (strides,) if isinstance(strides, int) else tuple(strides)
    rank = len(dims)
    out = ctypes.create_string_buffer(128)
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    rc = _libcuda().cuTensorMapEncodeTiled(
        out, _TMA_DTYPES[dtype], rank, ctypes.c_void_p(ptr), (u64 * rank)(*dims),
        (u64 * (rank - 1))(*(s * 2 for s in strides)), (u32 * rank)(*box),
        (u32 * rank)(*([1] * rank)), 0, _TMA_SWIZZLE_128B, _TMA_L2_256B, 0)
    if rc != 0:
        raise DeviceError(f"cuTensorMapEncodeTiled failed (CUresult {rc}) for a {dtype} "
                          f"array {dims} with strides {strides} and box {box}")
    return out.raw


_LIBCUDA: list[Any] = []


def _libcuda() -> Any:
    """The driver library PyCUDA runs on: modules are loaded and kernels launched through it
    directly (PyCUDA cannot launch on torch's streams, nor pass a TMA descriptor)."""
    if not _LIBCUDA:
        _drv()
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuTensorMapEncodeTiled.restype = ctypes.c_int
        u32, vp = ctypes.c_uint, ctypes.c_void_p
        lib.cuMemsetD32Async.argtypes = [ctypes.c_uint64, u32, ctypes.c_size_t, vp]
        lib.cuFuncSetAttribute.argtypes = [vp, ctypes.c_int, ctypes.c_int]
        lib.cuOccupancyMaxActiveBlocksPerMultiprocessor.argtypes = [
            ctypes.POINTER(ctypes.c_int), vp, ctypes.c_int, ctypes.c_size_t]
        _LIBCUDA.append(lib)
    return _LIBCUDA[0]


class Module:
    """One loaded cubin and its kernels, each resolved on first use and launched through the
    driver's per-parameter interface (:class:`_Kernel`), with its dynamic shared-memory limit
    raised as needed. ``signatures`` give each kernel's argument kinds ("PPii": two pointers,
    two ints; ``f`` float32, ``q`` int64, ``M`` a 128-byte by-value TMA descriptor)."""

    def __init__(self, cubin: bytes, signatures: Mapping[str, str]):
        self.signatures = dict(signatures)
        self._kernels: dict[str, _Kernel] = {}
        self._lib = _libcuda()
        self._keep = ctypes.create_string_buffer(cubin, len(cubin))
        handle = ctypes.c_void_p()
        with bound_context():
            _check(self._lib.cuModuleLoadData(ctypes.byref(handle), self._keep), "cuModuleLoadData")
        self.handle = handle

    def __del__(self) -> None:
        if getattr(self, "handle", None):
            self._lib.cuModuleUnload(self.handle)

    def function(self, name: str) -> _Kernel:
        """The kernel ``name``, resolved once."""
        f = self._kernels.get(name)
        if f is None:
            f = self._kernels[name] = _Kernel(self, name, self.signatures[name])
        return f

    def bind(self, name: str, grid: tuple[int, ...], block: tuple[int, ...],
             smem: int = 0, early: bool = False) -> Callable[..., None]:
        """``name`` with its grid, block and shared memory fixed (PyCUDA's prepared call):
        ``bound(stream, *args)`` enqueues it with one pack and one driver call, for launch
        closures that decide everything but the pointers once per call signature. ``early``:
        a programmatic dependent launch (sm_90), for a kernel that waits for the grid before it
        (``griddepcontrol.wait``) before touching memory."""
        return self._ready(name, smem).bind(grid, block, smem, early)

    def launch(self, name: str, grid: tuple[int, ...], block: tuple[int, ...], stream: int,
               *args: Any, smem: int = 0, early: bool = False) -> None:
        """Enqueue ``name`` on ``stream`` (a CUstream handle, 0: the legacy default stream) with
        ``smem`` bytes of dynamic shared memory (``early``: as ``bind``); an empty grid
        launches nothing. Nothing waits."""
        if 0 in grid:
            return
        f = self._ready(name, smem)
        (f.bound_early(grid, block, smem) if early else f.bind(grid, block, smem))(stream, *args)

    def resident(self, name: str, threads: int, smem: int = 0) -> int:
        """How many CTAs of ``name`` (``threads`` each) the device holds at once: the most a
        grid whose CTAs wait on work other CTAs claimed is worth launching."""
        return self._ready(name, smem).per_sm(threads, smem) * device_sms()

    def _ready(self, name: str, smem: int) -> _Kernel:
        """Kernel ``name``, allowed ``smem`` bytes of dynamic shared memory."""
        f = self._kernels.get(name) or self.function(name)
        if smem > f.smem_limit:
            f.set_smem_limit(smem)
        return f


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise DeviceError(f"{what} failed (CUresult {rc})")


#: ``cuLaunchKernel`` is called without ctypes argtypes (0.5 us less per launch): the grid,
#: block and shared-memory sizes go as C ints (all below 2**31), the handle and the parameter
#: arrays as pointers, and the stream wrapped in this (a 64-bit handle)
_VOID_P = ctypes.c_void_p

#: struct codes, sizes and host alignments of the signature letters
_PARAMS = {"P": ("Q", 8), "i": ("i", 4), "f": ("f", 4), "q": ("q", 8), "M": ("128s", 8)}

#: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_PROGRAMMATIC = 6
#: early-launch closures a kernel keeps (_Kernel.bound_early), one per grid, block and smem
_EARLY_KEPT = 64


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id and a 64-byte value union (its first int here)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_int),
                ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig of cuLaunchKernelEx."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("nattrs", ctypes.c_uint)]


class _Kernel:
    """One kernel, launched through ``cuLaunchKernel`` with its arguments packed by one
    ``struct.pack_into`` into a per-thread buffer laid out as the cubin's parameters (natural
    alignment). The driver reads the buffer whole (``CU_LAUNCH_PARAM_BUFFER_POINTER``, as
    PyCUDA does: 1.6 us per launch less than per-parameter pointers on an H100 host), except for
    kernels taking a 64-byte-aligned ``CUtensorMap`` by value, which get the per-parameter array
    (the driver then places each argument at the offset the cubin declares)."""

    def __init__(self, module: Module, name: str, signature: str):
        import struct
        self._lib = module._lib
        fmt, offsets, at = "=", [], 0
        for code in signature:
            c, size = _PARAMS[code]
            pad = -at % size
            fmt += "x" * pad + c
            offsets.append(at + pad)
            at += pad + (128 if code == "M" else size)
        self._struct, self._offsets = struct.Struct(fmt), offsets
        self._per_parameter = "M" in signature
        self._local = threading.local()
        self._early: dict[tuple, Callable[..., None]] = {}
        self._per_sm: dict[tuple[int, int], int] = {}
        self.handle = ctypes.c_void_p()
        _check(self._lib.cuModuleGetFunction(ctypes.byref(self.handle), module.handle,
                                             name.encode()), f"cuModuleGetFunction({name})")
        static = ctypes.c_int()
        _check(self._lib.cuFuncGetAttribute(ctypes.byref(static), _STATIC_SMEM, self.handle),
               f"cuFuncGetAttribute({name})")
        #: dynamic shared memory a launch may ask for without opting in: static and dynamic
        #: together stay within 48 KiB (the fused kernels hold their index pass's static arrays)
        self.smem_limit = 48 * 1024 - static.value

    def per_sm(self, threads: int, smem: int) -> int:
        """CTAs of ``threads`` threads and ``smem`` dynamic bytes one SM holds (asked once)."""
        n = self._per_sm.get((threads, smem))
        if n is None:
            out = ctypes.c_int()
            _check(self._lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                ctypes.byref(out), self.handle, threads, smem),
                "cuOccupancyMaxActiveBlocksPerMultiprocessor")
            n = self._per_sm[(threads, smem)] = out.value
        return n

    def set_smem_limit(self, smem: int) -> None:
        _check(self._lib.cuFuncSetAttribute(self.handle, _MAX_DYNAMIC_SMEM, smem),
               "cuFuncSetAttribute")
        self.smem_limit = smem

    def _buffers(self) -> tuple[Any, Any, Any]:
        """This thread's (argument buffer, kernelParams, extra) for cuLaunchKernel."""
        buf = ctypes.create_string_buffer(max(self._struct.size, 1))
        base = ctypes.addressof(buf)
        if self._per_parameter:
            params = (ctypes.c_void_p * len(self._offsets))(*(base + o for o in self._offsets))
            bufs = buf, params, None
        else:
            size = ctypes.c_size_t(self._struct.size)
            # CU_LAUNCH_PARAM_BUFFER_POINTER, buf, CU_LAUNCH_PARAM_BUFFER_SIZE, &size, END
            extra = (ctypes.c_void_p * 5)(1, base, 2, ctypes.addressof(size), 0)
            bufs = buf, None, (extra, size)
        self._local.bufs = bufs
        return bufs

    def bind(self, grid: tuple[int, ...], block: tuple[int, ...], smem: int,
             early: bool = False) -> Callable[..., None]:
        """The kernel with everything but the stream and the arguments fixed (Module.bind);
        ``early``: launched by ``cuLaunchKernelEx`` as a programmatic dependent launch."""
        if 0 in grid:
            return lambda stream, *args: None
        (gx, gy, gz), (bx, by, bz) = (int(d) for d in (*grid, 1, 1)[:3]), \
            (int(d) for d in (*block, 1, 1)[:3])
        smem = int(smem)
        if early:
            return self._bind_early((gx, gy, gz), (bx, by, bz), smem)
        driver, handle, pack, local = self._lib.cuLaunchKernel, self.handle, \
            self._struct.pack_into, self._local
        vp = _VOID_P

        def bound(stream: int, *args: Any) -> None:
            buf, params, extra = getattr(local, "bufs", None) or self._buffers()
            pack(buf, 0, *args)
            rc = driver(handle, gx, gy, gz, bx, by, bz, smem, vp(stream), params,
                        extra and extra[0])
            if rc:
                _check(rc, "cuLaunchKernel")
        return bound

    def bound_early(self, grid: tuple[int, ...], block: tuple[int, ...],
                    smem: int) -> Callable[..., None]:
        """``bind(..., early=True)``, kept per launch shape (Module.launch's early launches:
        a launch config costs 2.5 us of host time to build), at most _EARLY_KEPT of them."""
        key = (tuple(grid), tuple(block), smem)
        bound = self._early.get(key)
        if bound is None:
            if len(self._early) >= _EARLY_KEPT:
                self._early.clear()
            bound = self._early[key] = self.bind(grid, block, smem, True)
        return bound

    def _bind_early(self, grid: tuple[int, int, int], block: tuple[int, int, int],
                    smem: int) -> Callable[..., None]:
        """``bind``'s programmatic dependent launch: the grid may start while the kernel before
        it on the stream finishes (once that one's CTAs have all run ``griddepcontrol.
        launch_dependents`` or exited); this kernel's ``griddepcontrol.wait`` holds it until
        that grid has completed and its writes are visible. Each thread keeps its own config."""
        driver, handle, pack, local = self._lib.cuLaunchKernelEx, self.handle, \
            self._struct.pack_into, self._local
        mine = threading.local()   # this closure's config, per thread

        def config() -> Any:
            attr = _LaunchAttribute(id=_PROGRAMMATIC, value=1)
            cfg = _LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), smem,
                                None, ctypes.pointer(attr), 1)
            mine.cfg = cfg, ctypes.byref(cfg), attr
            return mine.cfg

        def bound(stream: int, *args: Any) -> None:
            buf, params, extra = getattr(local, "bufs", None) or self._buffers()
            cfg, ref, _ = getattr(mine, "cfg", None) or config()
            pack(buf, 0, *args)
            cfg.stream = stream
            rc = driver(ref, handle, params, extra and extra[0])
            if rc:
                _check(rc, "cuLaunchKernelEx")
        return bound


#: CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES
_MAX_DYNAMIC_SMEM, _STATIC_SMEM = 8, 1


def _finish_work() -> None:
    """Wait for the device before loaded modules are dropped: unloading one under a queued or
    running launch is undefined (pitgen.cache.clear)."""
    if _DRV:
        with bound_context() as drv:
            drv.Context.synchronize()


_MODULES = cache.memo("runtime.modules", before_clear=_finish_work)


def load(source: str, signatures: Mapping[str, str]) -> Module:
    """The module of ``source`` for the current device, compiled (through the on-disk cache)
    and loaded once per process and device."""
    arch = device_arch()
    key = (hashlib.sha256(source.encode()).hexdigest(), arch, device_index())
    mod = _MODULES.get(key)
    if mod is None:
        mod = _MODULES[key] = Module(compile_source(source, compile_target(arch)), signatures)
    return mod


_NVCC_POOL: list[ThreadPoolExecutor] = []
_NVCC_POOL_LOCK = threading.Lock()


def _nvcc_pool() -> ThreadPoolExecutor:
    """One pool of nvcc threads per process (compiles queued at exit still finish)."""
    with _NVCC_POOL_LOCK:
        if not _NVCC_POOL:
            _NVCC_POOL.append(ThreadPoolExecutor(os.cpu_count() or 2,
                                                 thread_name_prefix="pitgen-nvcc"))
        return _NVCC_POOL[0]


def compile_ahead(sources: Iterable[str]) -> list[Future]:
    """Start compiling ``sources`` for this device's nvcc target (the one :func:`load` uses)
    into the on-disk cubin cache, in background threads; returns their futures. A ``load`` of
    one of them meanwhile waits for its compile (the cache's entry lock) instead of repeating
    it. Callers that know their next kernels (the tuner) overlap nvcc with their GPU work."""
    target = compile_target(device_arch())   # in the caller's thread: its context is current
    pool = _nvcc_pool()
    return [pool.submit(compile_source, src, target) for src in dict.fromkeys(sources)]


def precompile(sources: Iterable[str]) -> int:
    """Compile ``sources`` as :func:`compile_ahead` does and wait for them; returns how many.
    Benchmarks and sweeps call this first so that their timings measure kernels, not first-use
    compiles. A compile error raises here."""
    jobs = compile_ahead(sources)
    for job in jobs:
        job.result()
    return len(jobs)


def memset_d32(ptr: int, value: int, count: int, stream: int) -> None:
    """Enqueue a fill of ``count`` 32-bit words at ``ptr`` with ``value`` on ``stream``."""
    _check(_libcuda().cuMemsetD32Async(ptr, value, count, stream), "cuMemsetD32Async")


class TorchLaunch:
    """Launch context: ``stream`` is the CUstream handle of torch's current stream on the
    current device (``use_torch=False``, PyCUDA GPUArray operands: the legacy default stream),
    and PyCUDA's shared primary context is current for the length of the block, from any thread
    (``bound_context``). Launches go straight onto torch's stream, so they are ordered with the
    caller's torch work as torch's own kernels are, and buffers from torch's caching allocator
    are reused in stream order with nothing to record."""

    __slots__ = ("stream", "_bound", "_use_torch")

    def __init__(self, use_torch: bool = True) -> None:
        self._use_torch = use_torch
        self._bound = None if _context_is_current() else bound_context()
        self.stream = 0

    def __enter__(self) -> TorchLaunch:
        if self._bound is not None:
            self._bound.__enter__()
        if self._use_torch:
            self.stream = current_stream()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bound is not None:
            self._bound.__exit__(*exc)


def current_stream(device: int | None = None) -> int:
    """The CUstream handle of torch's current stream on ``device`` (default: the current one)."""
    import torch
    return torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice() if device is None
                                              else device)


def capturing() -> bool:
    """Whether torch's current stream is capturing a CUDA graph. Launches then take fresh
    buffers (from the graph's private memory pool) instead of the per-stream buffers and
    counters they reuse between eager calls: graphs captured on one stream (torch's default
    capture stream) would otherwise share them, and race when replayed on two streams at once."""
    import torch
    return torch._C._cuda_isCurrentStreamCapturing()


#: bytes of scratch each stream keeps between eager calls (:func:`kept_scratch`); a call that
#: needs more allocates its own from torch's caching allocator (its host cost is small beside
#: the kernels of such a call)
KEPT_SCRATCH = 16 << 20

#: (device index, stream handle) -> (the scratch buffer kept there, the lock its users hold
#: while enqueueing)
_KEPT = cache.memo("runtime.kept_scratch")
_KEPT_LOCK = threading.Lock()


def kept_scratch(stream: int, nbytes: int, device: Any) -> tuple[Any, Any]:
    """(uint8 tensor of at least ``nbytes``, lock or None): the one scratch buffer ``stream``
    keeps for the launch closures of every operator (one allocation less per eager call),
    with the lock a caller holds while it enqueues the launches that use it (two threads on
    one stream must not interleave theirs; stream order keeps calls apart on the GPU). Larger
    requests, and calls while the stream captures a graph (``capturing``), get a fresh buffer
    and no lock. The kept buffer grows to the largest request up to KEPT_SCRATCH: memory stays
    bounded by streams, not by the call signatures seen."""
    import torch
    if nbytes > KEPT_SCRATCH or capturing():
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device), None
    return kept_buffer(stream, nbytes, device)


def kept_buffer(stream: int, nbytes: int, device: Any) -> tuple[Any, Any]:
    """:func:`kept_scratch` for a caller that has checked that the stream is not capturing and
    that ``nbytes`` is at most KEPT_SCRATCH: the kept buffer and its lock."""
    import torch
    key = (device.index, stream)   # every device's default stream is handle 0
    entry = _KEPT.get(key)
    if entry is None or entry[0].numel() < nbytes:
        with _KEPT_LOCK:
            entry = _KEPT.get(key)
            if entry is None or entry[0].numel() < nbytes:
                lock = entry[1] if entry is not None else threading.Lock()
                entry = _KEPT[key] = (torch.empty(max(nbytes, 1), dtype=torch.uint8,
                                                  device=device), lock)
    return entry


def stream_counters(by_stream: dict[int, Any], stream: int, size: int, device: Any) -> Any:
    """At least ``size`` int32 counters for launches on ``stream`` (a CUstream handle, as
    :class:`TorchLaunch` gives) whose kernels leave them zero again: zeroed once per stream in
    ``by_stream`` (and again when a launch needs more), so launches on one stream, which run in
    order, share them and none has to clear them first. A call captured into a CUDA graph gets
    fresh ones, zeroed by a captured memset on every replay (``capturing``)."""
    import torch
    if capturing():
        return torch.zeros(max(size, 1), dtype=torch.int32, device=device)
    buf = by_stream.get(stream)
    if buf is None or buf.numel() < size:
        buf = by_stream[stream] = torch.zeros(max(size, 1), dtype=torch.int32, device=device)
    return buf
