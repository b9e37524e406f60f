"""Compilation: CUDA source -> cubin with nvcc, behind an on-disk cache.

The cache (:mod:`pitgen.cache`) key covers the source, the options (arch included) and the nvcc version; the version
itself is remembered per nvcc binary (path, size, mtime), so a warm start of a new process loads
cubins without running nvcc at all. Entries are written to a temporary file and renamed into
place, so two processes compiling the same kernel at once both end with one complete file.
Compiling needs no GPU or driver: CI compiles every template variant this way.
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
    memo = cache.directory() / f"nvcc-{ident}.json"
    try:
        return json.loads(memo.read_text())["version"]
    except (OSError, ValueError, KeyError):
        pass
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
    version = next((ln.strip() for ln in out.splitlines() if "release" in ln), out.strip())
    cache.atomic_write(memo, json.dumps({"nvcc": nvcc, "version": version}).encode())
    return version


def arch_options(arch: str) -> tuple[str, ...]:
    """nvcc's target options for ``arch``: ``sm_90a`` (wgmma, setmaxnreg) is spelled as a
    -gencode pair, since the ``-arch=sm_90a`` shorthand of nvcc 13.0 also runs a plain sm_90
    pass that rejects those instructions."""
    if arch.endswith("a"):
        return (f"-gencode=arch=compute_{arch[3:]},code={arch}",)
    return (f"-arch={arch}",)


def compile_source(source: str, arch: str, extra: tuple[str, ...] = ()) -> bytes:
    """Cubin for ``arch`` (``"sm_90"``), from the cache when the same source, options and nvcc
    were seen before."""
    nvcc = find_nvcc()
    options = (*arch_options(arch), *BASE_OPTIONS, *extra)
    path = cache.directory() / f"{cache.key(source, chr(0).join(options), nvcc_version(nvcc))}.cubin"
    try:
        return path.read_bytes()
    except OSError:
        pass
    with tempfile.TemporaryDirectory(prefix="pitgen-") as tmp:
        src, out = Path(tmp, "kernel.cu"), Path(tmp, "kernel.cubin")
        src.write_text(source)
        proc = subprocess.run([nvcc, "-cubin", *options, "-o", str(out), str(src)],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise CompileError(f"nvcc failed ({' '.join(options)}):\n{proc.stderr[-4000:]}")
        data = out.read_bytes()
    cache.atomic_write(path, data)
    return data
