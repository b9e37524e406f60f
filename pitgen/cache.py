"""Every cache pitgen keeps, in one place.

On disk: one directory (``$PITGEN_CACHE`` or ``~/.cache/pitgen``) holding compiled cubins, the
nvcc version memo and, under ``tune/``, graph tuning results; entries are named by :func:`key`
and written by :func:`atomic_write`, so concurrent processes never see half a file.

Entries of :func:`load` / :func:`store` heal themselves: each file starts with a header holding
the payload's SHA-256, so a truncated, empty or overwritten entry is noticed on load (with a
warning) and built again; :func:`locked` serialises the processes building one entry (an
``fcntl`` lock), so the others wait and then load it. A cache directory that cannot be created
or written (read-only, a file in its place) turns into an in-process store, with one warning.

In process: every memo a module keeps (rule derivations, plans per shape, loaded modules, the
per-stream counters) is registered here by name, so :func:`inventory` lists them with their
sizes and :func:`clear` empties them all (tests, a device reset, or a long-lived server that
wants its memory back).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: processes are not serialised
    fcntl = None  # type: ignore[assignment]

from .errors import FileError

F = TypeVar("F", bound=Callable[..., Any])


def _root(sub: str | None) -> Path:
    root = os.environ.get("PITGEN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pitgen")
    return Path(root) / sub if sub else Path(root)


def directory(sub: str | None = None) -> Path:
    """``$PITGEN_CACHE`` (or ``~/.cache/pitgen``), or its subfolder ``sub``; created on demand.
    :class:`FileError` when it cannot be (a file in its place, no permission)."""
    return make_directory(_root(sub), "the cache directory", "PITGEN_CACHE")


def make_directory(path: Path, what: str, variable: str) -> Path:
    """``path``, created if missing; :class:`FileError` naming ``what`` and the environment
    ``variable`` that chose it when it cannot be."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FileError(f"cannot use {what} {str(path)!r} ({variable}): "
                        f"{e.strerror or e}") from None
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
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


#: Entry files: MAGIC, the payload's SHA-256 (32 bytes), then the payload.
MAGIC = b"PITGEN\x01\n"
_HEADER = len(MAGIC) + 32
#: Directories found unusable in this process (warned about once each): their entries live in
#: _MEMORY instead.
_UNUSABLE: set[Path] = set()
_STATE_LOCK = threading.RLock()
_THREAD_LOCKS: dict[Path, threading.Lock] = {}


def _entry_dir(sub: str | None) -> Path | None:
    """The directory for entries of ``sub``, or None when it is unusable (warned once)."""
    path = _root(sub)
    if path in _UNUSABLE:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(13, "not writable")
    except OSError as e:
        _give_up(path, e)
        return None
    return path


def _give_up(path: Path, e: OSError) -> None:
    with _STATE_LOCK:
        if path not in _UNUSABLE:
            _UNUSABLE.add(path)
            warnings.warn(f"pitgen cache: cannot use {str(path)!r} ({e.strerror or e}); keeping "
                          f"this process's entries in memory (set PITGEN_CACHE to a writable "
                          f"directory)", RuntimeWarning, stacklevel=3)


def load(name: str, sub: str | None = None,
         valid: Callable[[bytes], bool] | None = None) -> bytes | None:
    """The payload of entry ``name``, or None when absent. A damaged entry (bad header, a hash
    that does not match, or a payload that ``valid`` refuses) is removed with a warning, so that
    it is built again."""
    folder = _entry_dir(sub)
    if folder is None:
        return _MEMORY.get(str(_root(sub) / name))
    path = folder / name
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        warnings.warn(f"pitgen cache: cannot read {path}: {e.strerror or e}; building it again",
                      RuntimeWarning, stacklevel=2)
        return None
    payload = raw[_HEADER:]
    why = ("empty" if not raw else "no pitgen header" if raw[:len(MAGIC)] != MAGIC
           else "truncated or altered (hash mismatch)"
           if hashlib.sha256(payload).digest() != raw[len(MAGIC):_HEADER]
           else "not what this entry holds" if valid is not None and not valid(payload) else None)
    if why is None:
        return payload
    warnings.warn(f"pitgen cache: entry {path} is damaged ({why}); building it again",
                  RuntimeWarning, stacklevel=2)
    with contextlib.suppress(OSError):
        path.unlink()
    return None


def store(name: str, payload: bytes, sub: str | None = None) -> None:
    """Write entry ``name`` (atomically, with its header); in memory when the directory is
    unusable, or turns out to be on this first write (read-only: one warning)."""
    folder = _entry_dir(sub)
    if folder is not None:
        try:
            atomic_write(folder / name, MAGIC + hashlib.sha256(payload).digest() + payload)
            return
        except OSError as e:
            _give_up(folder, e)
    _MEMORY[str(_root(sub) / name)] = payload


@contextlib.contextmanager
def locked(name: str, sub: str | None = None) -> Iterator[Path | None]:
    """Hold the lock of entry ``name`` (threads of this process, and processes through an
    ``fcntl`` lock file under ``locks/``); yields a scratch directory for building it (inside
    the cache, removed afterwards, and a killed builder's leftovers removed before), or None
    when the cache lives in memory."""
    folder = _entry_dir(sub)
    key = (folder or _root(sub)) / name
    with _STATE_LOCK:
        thread_lock = _THREAD_LOCKS.setdefault(key, threading.Lock())
    with thread_lock:
        if folder is None or fcntl is None:
            yield None
            return
        try:
            (folder / "locks").mkdir(exist_ok=True)
            fd = os.open(folder / "locks" / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            _give_up(folder, e)
            yield None
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            for stale in folder.glob(f"{name}.*.tmp"):  # a killed writer's: we hold the lock
                if stale.is_dir():
                    shutil.rmtree(stale, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        stale.unlink()
            scratch = folder / f"{name}.{os.getpid()}.build.tmp"
            scratch.mkdir()
            try:
                yield scratch
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        finally:
            os.close(fd)  # releases the lock


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


#: Entries of unusable cache directories, for this process, by path.
_MEMORY: dict[str, bytes] = memo("cache.memory")


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


# -- the on-disk areas (``pitgen cache info|clear``) --------------------------------------------

#: What the cache directory holds: compiled kernels (cubins and the nvcc memo, the root's
#: entry files), graph tuning results, generated graphs.
AREAS = ("kernels", "tune", "graphs")


def area_path(area: str) -> Path:
    """Where ``area`` lives (not created): kernels at the root, tune in ``$PITGEN_TUNE_CACHE``
    or ``<root>/tune``, graphs in ``<root>/graphs``; FileError for an unknown area."""
    if area == "kernels":
        return _root(None)
    if area == "tune":
        env = os.environ.get("PITGEN_TUNE_CACHE")
        return Path(env) if env else _root("tune")
    if area == "graphs":
        return _root("graphs")
    raise FileError(f"unknown cache area {area!r}; the areas are {', '.join(AREAS)}")


def _area_files(area: str) -> list[Path]:
    """The files of ``area``: the root's files for kernels (not its subfolders), every file
    below the folder otherwise; none when the folder is missing."""
    path = area_path(area)
    if not path.is_dir():
        return []
    if area == "kernels":
        return [p for p in path.iterdir() if p.is_file()]
    return [p for p in path.rglob("*") if p.is_file()]


def disk_usage() -> dict[str, dict[str, Any]]:
    """Each on-disk area's folder, number of files and bytes (nothing is created)."""
    out = {}
    for area in AREAS:
        files = _area_files(area)
        size = 0
        for p in files:
            with contextlib.suppress(OSError):  # removed meanwhile by another process
                size += p.stat().st_size
        out[area] = {"path": str(area_path(area)), "files": len(files), "bytes": size}
    return out


def disk_clear(areas: tuple[str, ...] = AREAS) -> dict[str, int]:
    """Remove the files of ``areas`` (their folders stay); the number removed per area.
    Entries are rebuilt on demand (kernels recompiled, graphs generated, tuned results
    searched again only when asked). A file that cannot be removed is a FileError."""
    removed = {}
    for area in areas:
        files = _area_files(area)
        for p in files:
            try:
                p.unlink()
            except FileNotFoundError:
                continue
            except OSError as e:
                raise FileError(f"cannot remove {p}: {e.strerror or e}") from None
        removed[area] = len(files)
    return removed
