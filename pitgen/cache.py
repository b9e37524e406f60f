"""Every cache pitgen keeps, in one place.

On disk: one directory (``$PITGEN_CACHE`` or ``~/.cache/pitgen``) holding compiled cubins, the
nvcc version memo and, under ``tune/``, graph tuning results; entries are named by :func:`key`
and written by :func:`atomic_write`, so concurrent processes never see half a file.

In process: every memo a module keeps (rule derivations, plans per shape, loaded modules, the
per-stream counters) is registered here by name, so :func:`inventory` lists them with their
sizes and :func:`clear` empties them all (tests, a device reset, or a long-lived server that
wants its memory back).
"""
from __future__ import annotations

import functools
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def directory(sub: str | None = None) -> Path:
    """``$PITGEN_CACHE`` (or ``~/.cache/pitgen``), or its subfolder ``sub``; created on demand."""
    root = os.environ.get("PITGEN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pitgen")
    path = Path(root) / sub if sub else Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def key(*parts: str) -> str:
    """Hex digest naming a cache entry: the parts are separated, so ("ab", "c") != ("a", "bc")."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\1")
    return h.hexdigest()


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path`` and rename it into place."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


#: name -> the registered cache (a dict, or an lru_cache-wrapped function)
_REGISTRY: dict[str, Any] = {}
#: name -> what must happen before that cache is emptied
_BEFORE_CLEAR: dict[str, Callable[[], None]] = {}


def memo(name: str, before_clear: Callable[[], None] | None = None) -> dict:
    """A process-wide dict registered under ``name`` (the same dict on every call).
    ``before_clear`` runs before :func:`clear` empties it (e.g. waiting for the GPU work that
    still uses the loaded modules it holds)."""
    if before_clear is not None:
        _BEFORE_CLEAR[name] = before_clear
    return _REGISTRY.setdefault(name, {})


def lru(name: str, maxsize: int | None = 256) -> Callable[[F], F]:
    """``functools.lru_cache`` registered under ``name``."""
    def wrap(fn: F) -> F:
        cached = functools.lru_cache(maxsize=maxsize)(fn)
        _REGISTRY[name] = cached
        return cached  # type: ignore[return-value]
    return wrap


def inventory() -> dict[str, int]:
    """Entries held by each in-process cache, by name."""
    return {name: (c.cache_info().currsize if hasattr(c, "cache_info") else len(c))
            for name, c in sorted(_REGISTRY.items())}


def clear() -> None:
    """Empty every in-process cache (the on-disk cache stays: it is keyed by content)."""
    for hook in _BEFORE_CLEAR.values():
        hook()
    for c in _REGISTRY.values():
        if hasattr(c, "cache_clear"):
            c.cache_clear()
        else:
            c.clear()
