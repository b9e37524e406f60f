"""Operands: device arrays (CUDA torch tensors, PyCUDA GPUArrays) seen as what kernels need
(pointer, shape, element strides, dtype), validated with the pitgen error that names what is
wrong, and the per-call device buffers the launches use."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence, TypeVar

import numpy as np

from .errors import DeviceError, ShapeError

F = TypeVar("F", bound=Callable[..., Any])


def bind_operands(text: str, names: Sequence[str], args: tuple,
                  kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Positional and keyword operands of a call matched to the expression's input names, with
    a ShapeError naming what is missing, unknown or given twice."""
    if len(args) > len(names):
        raise ShapeError(f"{text!r} takes {len(names)} operands ({', '.join(names)}), "
                         f"got {len(args)}")
    bound = dict(zip(names, args))
    for k, v in kwargs.items():
        if k not in names:
            raise ShapeError(f"unknown operand {k!r} (operands: {', '.join(names)})")
        if k in bound:
            raise ShapeError(f"operand {k!r} given twice")
        bound[k] = v
    missing = [n for n in names if n not in bound]
    if missing:
        raise ShapeError(f"missing operand(s) {', '.join(missing)}")
    return bound


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


def check_device(name: str, x: Any) -> None:
    """A torch tensor must be on the current CUDA device (the one PyCUDA's context runs on)."""
    import torch
    if not x.is_cuda:
        raise DeviceError(f"{name} is on {x.device}; pitgen kernels need CUDA tensors "
                          f"(move it with .cuda())")
    # torch.cuda.current_device() without its wrappers; under torch.compile the public call,
    # which dynamo folds to a constant (it puts torch._C's into the graph: a break)
    current = (torch.cuda.current_device() if torch.compiler.is_compiling()
               else torch._C._cuda_getDevice())
    if x.device.index != current:
        raise DeviceError(f"{name} is on {x.device} but this call runs on cuda:{current} (its "
                          f"first operand's device): every operand must be on one device")


_PLAIN: list[Any] = []


def _plain() -> list[Any]:
    """[torch.Tensor, torch._C._cuda_getDevice, torch.compiler.is_compiling, torch.device],
    or Nones without a usable torch: what the per-call fast checks read, looked up once."""
    if not _PLAIN:
        try:
            import torch
            usable = torch.cuda.is_available()
        except ImportError:
            usable = False
        _PLAIN[:] = [torch.Tensor, torch._C._cuda_getDevice, torch.compiler.is_compiling,
                     torch.device] if usable else [None] * 4
    return _PLAIN


def _other_device(args: tuple, kwargs: Mapping[str, Any]) -> int | None:
    """The index of the device the first argument with a CUDA ``device`` (a tensor, a
    DeviceCSR, ...) is on, when that is not torch's current device; None otherwise (nothing to
    switch: the common case costs one attribute read)."""
    tensor, current, compiling, device = _plain()
    if tensor is None or compiling():
        return None
    for x in (*args, *kwargs.values()):
        if isinstance(x, tensor):
            dev = x.get_device()
        else:  # a DeviceCSR, DeviceMatrix, ...: its ``device``
            d = getattr(x, "device", None)
            if not isinstance(d, device):
                continue
            dev = d.index if d.type == "cuda" and d.index is not None else -1
        return dev if dev >= 0 and dev != current() else None
    return None


def on_operand_device(fn: F) -> F:
    """The device guard of a public operator: ``fn`` runs on the device of its first argument
    that has one (a torch tensor, a DeviceCSR), torch's current device switched there for the
    call when it differs (``torch.cuda.device``), so the launches, modules, streams and buffers
    are that device's, as torch's own ops do. Operands on other devices than that one are
    refused by validation (:func:`check_device`, a DeviceError naming both devices)."""
    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        dev = _other_device(args, kwargs)
        if dev is None:
            return fn(*args, **kwargs)
        import torch
        with torch.cuda.device(dev):
            return fn(*args, **kwargs)
    return guarded  # type: ignore[return-value]


def raw_key(*xs: Any) -> tuple | None:
    """What validation of torch operands depends on, read straight off the tensors: the current
    device and each one's shape, strides, dtype, device and pointer alignment (None entries stay
    None). None when one is not a plain CUDA-capable torch tensor, or while torch traces. A call
    whose key was validated before needs no validation again: operators memoise their plan by it."""
    tensor, device, compiling, _ = _plain()
    if tensor is None or compiling():
        return None
    key: list[Any] = [device()]
    for x in xs:
        if x is None:
            key.append(None)
        elif type(x) is tensor:
            key.append((x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15))
        else:
            return None
    return tuple(key)


#: entries a validation memo (:func:`validated`) holds before it starts over
VALIDATED_KEYS = 4096


def validated(memo: dict, key: Any, check: Callable[[], Any]) -> Any:
    """``check()`` (an operator's validation: a pitgen error, or its plan; or a launch closure
    built once per call signature), memoised in ``memo`` by ``key`` (a :func:`raw_key`, possibly
    with more hashable parts, or a plan; None: not memoised), so that a steady-state call skips
    that work. The memo empties when it holds VALIDATED_KEYS."""
    if key is None:
        return check()
    hit = memo.get(key)
    if hit is None:
        hit = check()
        if len(memo) >= VALIDATED_KEYS:
            memo.clear()
        memo[key] = hit
    return hit


def as_operand(name: str, x: Any) -> Operand:
    """Accept a CUDA torch tensor or a PyCUDA GPUArray; refuse anything else with the reason."""
    mod = type(x).__module__
    if mod.startswith("torch"):
        import torch
        if not isinstance(x, torch.Tensor):
            raise ShapeError(f"{name}: expected a tensor, got {type(x).__name__}")
        check_device(name, x)
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


class Workspace:
    """Device buffers for one call, from torch's caching allocator when the operands are torch
    tensors (stream-ordered reuse on the stream the call launches on), else from PyCUDA."""

    def __init__(self, is_torch: bool):
        self.torch = is_torch

    def alloc(self, shape: tuple[int, ...], dtype: str) -> Any:
        if self.torch:
            import torch
            return torch.empty(shape, dtype=getattr(torch, dtype), device="cuda")
        import pycuda.gpuarray as ga
        return ga.empty(shape, dtype=np.dtype(dtype))

    @staticmethod
    def ptr(x: Any) -> int:
        return x.data_ptr() if hasattr(x, "data_ptr") else int(x.gpudata)


def align(ptr: int) -> int:
    """Largest power-of-two alignment of a device pointer, capped at 16 bytes."""
    return min(16, ptr & -ptr) if ptr else 16


def signature(ops: dict[str, Operand], out: Operand | None, accumulate: bool,
              mask: Operand | None = None) -> tuple:
    """Everything a launch plan depends on besides the data: shapes, strides, dtypes, array
    kinds and pointer alignment. Calls with equal signatures reuse one :class:`Launcher`."""
    extra = [("out", out), ("mask", mask)]
    parts = [(o.name, o.shape, o.strides, o.dtype, o.is_torch, align(o.ptr))
             for o in (*ops.values(), *(x for _, x in extra if x is not None))]
    return tuple(parts), accumulate, out is not None, mask is not None


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def distinct_strides(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """True when no two in-range indices map to one element (dims sorted by stride nest)."""
    dims = sorted((st, n) for n, st in zip(shape, strides) if n > 1)
    span = 1
    for st, n in dims:
        if st < span:
            return False
        span = st * n
    return True


def check_tensor(name: str, x: Any, dtypes: tuple[str, ...], ndim: int | None = None,
                 shape: tuple[int | None, ...] | None = None, contiguous: bool = True) -> Any:
    """Validate a CUDA torch tensor operand, raising the pitgen error that names what is wrong
    (type, device, dtype, rank, shape, layout); returns ``x``."""
    import torch
    if not isinstance(x, torch.Tensor):
        raise ShapeError(f"{name}: expected a torch tensor, got {type(x).__name__}")
    check_device(name, x)
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
