"""Compilation: CUDA source -> cubin with nvcc, behind an on-disk cache.

The cache (:mod:`pitgen.cache`) key covers the source, the options (arch included), the nvcc
version and every variable of the environment that nvcc reads (``NVCC_APPEND_FLAGS`` turns a
build into a ``-G`` build); the version itself is remembered per nvcc binary (path, size, mtime),
so a warm start of a new process loads cubins without running nvcc at all. Each entry is checked
on load (its hash, and an ELF cubin inside) and rebuilt when damaged; one process compiles a
kernel while the others that want it wait for the entry (a file lock). Compiling needs no GPU or
driver: CI compiles every template variant this way.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from . import cache
from .errors import CompileError

BASE_OPTIONS = ("-std=c++17", "-O3")
#: Environment variables nvcc reads (its flags, its host compiler, the host include paths):
#: each is part of the cache key.
NVCC_ENVIRONMENT = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "NVCC_CCBIN", "CPATH",
                    "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH")
ELF_MAGIC = b"\x7fELF"
#: Part of every key: entries of an older layout (no header) are never read, only left behind.
ENTRY_FORMAT = "cubin-2"


def find_nvcc() -> str:
    """Path of nvcc: ``$PITGEN_NVCC``, ``$CUDA_HOME/bin``, PATH, or /usr/local/cuda/bin."""
    cands = [os.environ.get("PITGEN_NVCC"),
             os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if os.environ.get("CUDA_HOME") else None,
             shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise CompileError("nvcc not found: set PITGEN_NVCC or CUDA_HOME, or put nvcc on PATH")


def nvcc_version(nvcc: str | None = None) -> str:
    """The ``release`` line of ``nvcc --version``, remembered per binary identity."""
    nvcc = nvcc or find_nvcc()
    st = os.stat(nvcc)
    ident = hashlib.sha256(f"{os.path.realpath(nvcc)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    name = f"nvcc-{ident}.json"
    memo = cache.load(name)
    try:
        return json.loads(memo)["version"]
    except (TypeError, ValueError, KeyError):
        pass
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                             check=False).stdout
    except OSError as e:
        raise CompileError(f"cannot run {nvcc}: {e.strerror or e}") from None
    version = next((ln.strip() for ln in out.splitlines() if "release" in ln), out.strip())
    cache.store(name, json.dumps({"nvcc": nvcc, "version": version}).encode())
    return version


def arch_options(arch: str) -> tuple[str, ...]:
    """nvcc's target options for ``arch``: ``sm_90a`` (wgmma, setmaxnreg) is spelled as a
    -gencode pair, since the ``-arch=sm_90a`` shorthand of nvcc 13.0 also runs a plain sm_90
    pass that rejects those instructions."""
    if arch.endswith("a"):
        return (f"-gencode=arch=compute_{arch[3:]},code={arch}",)
    return (f"-arch={arch}",)


def nvcc_environment() -> tuple[str, ...]:
    """``NAME=value`` of each variable of NVCC_ENVIRONMENT that is set."""
    return tuple(f"{v}={os.environ[v]}" for v in NVCC_ENVIRONMENT if v in os.environ)


def _is_cubin(data: bytes) -> bool:
    return len(data) > len(ELF_MAGIC) and data.startswith(ELF_MAGIC)


def compile_source(source: str, arch: str, extra: tuple[str, ...] = ()) -> bytes:
    """Cubin for ``arch`` (``"sm_90"``), from the cache when the same source, options, nvcc
    and nvcc environment were seen before."""
    nvcc = find_nvcc()
    options = (*arch_options(arch), *BASE_OPTIONS, *extra)
    name = cache.key(ENTRY_FORMAT, source, chr(0).join(options), nvcc_version(nvcc),
                     *nvcc_environment()) + ".cubin"
    data = cache.load(name, valid=_is_cubin)
    if data is not None:
        return data
    with cache.locked(name) as scratch:
        data = cache.load(name, valid=_is_cubin)  # built by another process while we waited
        if data is None:
            data = _nvcc(nvcc, source, options, scratch)
            cache.store(name, data)
    return data


def _nvcc(nvcc: str, source: str, options: tuple[str, ...], scratch: Path | None) -> bytes:
    """Run nvcc on ``source`` in ``scratch`` (a temporary directory when None)."""
    with tempfile.TemporaryDirectory(prefix="pitgen-") as tmp:
        work = scratch or Path(tmp)
        src, out = work / "kernel.cu", work / "kernel.cubin"
        src.write_text(source)
        try:
            proc = subprocess.run([nvcc, "-cubin", *options, "-o", str(out), str(src)],
                                  capture_output=True, text=True, check=False)
        except OSError as e:
            raise CompileError(f"cannot run {nvcc}: {e.strerror or e}") from None
        if proc.returncode != 0:
            raise CompileError(f"nvcc failed ({' '.join(options)}):\n{proc.stderr[-4000:]}")
        try:
            data = out.read_bytes()
        except OSError as e:
            raise CompileError(f"nvcc wrote no cubin ({' '.join(options)}): {e}") from None
    if not _is_cubin(data):
        raise CompileError(f"nvcc's output is not an ELF cubin ({len(data)} bytes)")
    return data
