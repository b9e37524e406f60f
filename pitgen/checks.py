"""Validation shared by the public functions: each checks its arguments here, up front, so that a
bad value is a :class:`PitgenError` naming the argument rather than a NumPy or Python exception
from deep inside (or an allocation the machine cannot make)."""
from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from .errors import PitgenError, ShapeError
from .limits import INT64_MAX

#: Array dtype kinds accepted as values or masks: bool, signed and unsigned integers, floats.
NUMERIC_KINDS = "biuf"


def dtype_name(dtype: Any) -> Any:
    """``dtype`` as its name when it is a torch or NumPy dtype (``torch.float16`` ->
    ``'float16'``), else unchanged: callers check the name against what they run."""
    if isinstance(dtype, str):
        return dtype
    text = str(dtype)
    if text.startswith("torch."):
        return text[len("torch."):]
    try:
        return np.dtype(dtype).name if isinstance(dtype, (np.dtype, type)) else dtype
    except TypeError:
        return dtype


def integer(value: Any, what: str, *, minimum: int = 1, maximum: int = INT64_MAX,
            error: type[PitgenError] = ShapeError) -> int:
    """``value`` as an int in [minimum, maximum]: a float (even 64.0), a bool or a string is
    refused rather than truncated or parsed."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise error(f"{what} must be an integer, got {value!r} ({type(value).__name__})")
    v = int(value)
    if v < minimum or v > maximum:
        kind = {0: "a non-negative integer", 1: "a positive integer"}.get(
            minimum, f"an integer of at least {minimum}")
        raise error(f"{what} must be {kind} (at most {maximum}), got {v}")
    return v


def extents(value: Any, what: str, rank: int | None = None, *, minimum: int = 1,
            error: type[PitgenError] = ShapeError) -> tuple[int, ...]:
    """A shape: a sequence of ``rank`` integers each >= ``minimum``, with an int64 element
    count."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        raise error(f"{what} must be a sequence of integers, got {value!r}")
    out = tuple(integer(v, f"{what}[{i}]", minimum=minimum, error=error)
                for i, v in enumerate(value))
    if rank is not None and len(out) != rank:
        raise error(f"{what} {out} must have {rank} extents, has {len(out)}")
    count = 1
    for n in out:
        count *= n
    if count > INT64_MAX:
        raise error(f"{what} {out} has {count} elements, beyond int64")
    return out


def numeric_array(value: Any, what: str, *, kinds: str = NUMERIC_KINDS,
                  error: type[PitgenError] = ShapeError) -> np.ndarray:
    """``value`` as a NumPy array whose dtype is bool, integer or floating (``kinds``): strings,
    dates, complex numbers, objects and structured records are refused, never cast."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor: not read here
        raise error(f"{what} must be a NumPy array on the host, got a torch tensor")
    try:
        a = np.asarray(value)
    except (ValueError, TypeError, OverflowError) as e:
        raise error(f"{what} is not an array: {e}") from None
    if a.dtype.kind not in kinds:
        allowed = {"b": "bool", "i": "integer", "u": "unsigned integer", "f": "floating"}
        names = ", ".join(allowed[k] for k in kinds)
        raise error(f"{what} has dtype {a.dtype}; expected {names} values")
    return a


def memory_bytes() -> int:
    """The memory the machine has available now (``MemAvailable`` where /proc/meminfo has it,
    else its physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: no usable bound
        return INT64_MAX


def allocation(elements: int, itemsize: int, what: str,
               error: type[PitgenError] = ShapeError) -> None:
    """Refuse, before allocating, host arrays of ``elements`` that would take more than half of
    the memory available: filling them would swap or take minutes (an ELL of width 2**31 on a
    host of 128 GiB), and the conversion makes temporaries of a similar size beside them."""
    need, have = int(elements) * int(itemsize), memory_bytes()
    if need > have // 2:
        raise error(f"{what} would need {need / 2**30:.3g} GiB ({elements} elements), more than "
                    f"half of the {have / 2**30:.3g} GiB of memory available")
