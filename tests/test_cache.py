"""The compile cache heals itself and never loses work: damaged entries (truncated, empty,
garbage) are rebuilt with a warning; nvcc's environment is part of the key; a cache directory
that is read-only or a file falls back to memory with one warning; concurrent processes compile
a kernel once; a killed compile leaves nothing behind once the entry is built again. nvcc is a
fake script here (PITGEN_NVCC) that logs its runs: fast, and countable."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

import pitgen
from pitgen import cache, compiler

SOURCE = 'extern "C" __global__ void k(float* x) { x[0] = 1.0f; }'
ROOT = str(Path(pitgen.__file__).resolve().parents[1])

FAKE_NVCC = r"""#!/bin/sh
if [ "$1" = "--version" ]; then echo "Cuda compilation tools, release 99.9, V99.9.0"; exit 0; fi
echo "$$" >> "$FAKE_NVCC_LOG"
sleep "${FAKE_NVCC_SLEEP:-0}"
out=""; prev=""
for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
printf '\177ELF fake cubin [%s]' "$NVCC_APPEND_FLAGS" > "$out"
"""


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A fake nvcc and a fresh cache directory; ``fake.runs()`` counts the compiles."""
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(FAKE_NVCC)
    nvcc.chmod(0o755)
    log = tmp_path / "nvcc.log"
    log.touch()
    monkeypatch.setenv("PITGEN_NVCC", str(nvcc))
    monkeypatch.setenv("FAKE_NVCC_LOG", str(log))
    monkeypatch.setenv("PITGEN_CACHE", str(tmp_path / "cache"))
    for v in compiler.NVCC_ENVIRONMENT:
        monkeypatch.delenv(v, raising=False)

    class Fake:
        dir = tmp_path / "cache"

        @staticmethod
        def runs() -> int:
            return len(log.read_text().split())

        @staticmethod
        def entries() -> list[Path]:
            return sorted(Fake.dir.glob("*.cubin"))

        @staticmethod
        def leftovers() -> list[str]:
            return [p.name for p in Fake.dir.iterdir() if p.name.endswith(".tmp")]

    return Fake


def test_entries_are_reused_and_leave_nothing_temporary(fake):
    first = compiler.compile_source(SOURCE, "sm_90")
    assert first.startswith(b"\x7fELF") and fake.runs() == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compiler.compile_source(SOURCE, "sm_90") == first
    assert fake.runs() == 1 and len(fake.entries()) == 1 and not fake.leftovers()


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage", "not_elf"])
def test_a_damaged_entry_is_rebuilt_with_a_warning(fake, damage):
    good = compiler.compile_source(SOURCE, "sm_90")
    (entry,) = fake.entries()
    raw = entry.read_bytes()
    bad = {"truncated": raw[:-5], "empty": b"", "garbage": os.urandom(len(raw)),
           "not_elf": cache.MAGIC + __import__("hashlib").sha256(b"MZ junk").digest() + b"MZ junk"}
    entry.write_bytes(bad[damage])
    with pytest.warns(RuntimeWarning, match="damaged"):
        assert compiler.compile_source(SOURCE, "sm_90") == good
    assert fake.runs() == 2
    assert compiler.compile_source(SOURCE, "sm_90") == good and fake.runs() == 2   # healed


def test_nvcc_environment_is_in_the_key(fake, monkeypatch):
    plain = compiler.compile_source(SOURCE, "sm_90")
    monkeypatch.setenv("NVCC_APPEND_FLAGS", "-G")
    debug = compiler.compile_source(SOURCE, "sm_90")
    assert debug != plain and b"-G" in debug and fake.runs() == 2
    monkeypatch.setenv("NVCC_PREPEND_FLAGS", "-lineinfo")
    compiler.compile_source(SOURCE, "sm_90")
    assert fake.runs() == 3
    monkeypatch.delenv("NVCC_APPEND_FLAGS")
    monkeypatch.delenv("NVCC_PREPEND_FLAGS")
    assert compiler.compile_source(SOURCE, "sm_90") == plain and fake.runs() == 3


def test_a_file_in_place_of_the_directory_falls_back_to_memory(fake, monkeypatch, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("PITGEN_CACHE", str(blocker))
    with pytest.warns(RuntimeWarning, match="in memory") as seen:
        a = compiler.compile_source(SOURCE, "sm_90")
        b = compiler.compile_source(SOURCE, "sm_90")
    assert a == b and fake.runs() == 1
    assert sum("in memory" in str(w.message) for w in seen) == 1   # one warning
    assert blocker.read_text() == ""


def test_a_read_only_directory_falls_back_to_memory(fake, monkeypatch):
    """Writes fail as on a read-only file system (root may write through a 0o555 mode, so the
    failure is injected where the entry is written)."""
    def refuse(path, data):
        raise PermissionError(13, "Read-only file system", str(path))

    monkeypatch.setattr(cache, "atomic_write", refuse)
    with pytest.warns(RuntimeWarning, match="in memory") as seen:
        a = compiler.compile_source(SOURCE, "sm_90")
        b = compiler.compile_source(SOURCE, "sm_90")
    assert a == b and a.startswith(b"\x7fELF") and fake.runs() == 1
    assert sum("in memory" in str(w.message) for w in seen) == 1
    assert not fake.entries() and not fake.leftovers()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_a_read_only_mode_falls_back_to_memory(fake):
    fake.dir.mkdir()
    fake.dir.chmod(0o555)
    try:
        with pytest.warns(RuntimeWarning, match="in memory"):
            assert compiler.compile_source(SOURCE, "sm_90").startswith(b"\x7fELF")
    finally:
        fake.dir.chmod(0o755)


CHILD = textwrap.dedent("""
    import sys
    from pitgen import compiler
    sys.stdout.buffer.write(compiler.compile_source(sys.argv[1], "sm_90"))
""")


def _child(source: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.Popen([sys.executable, "-c", CHILD, source], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_concurrent_processes_compile_once(fake, monkeypatch):
    monkeypatch.setenv("FAKE_NVCC_SLEEP", "1")
    procs = [_child(SOURCE) for _ in range(3)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err.decode() for _, err in outs]
    assert len({out for out, _ in outs}) == 1 and outs[0][0].startswith(b"\x7fELF")
    assert fake.runs() == 1 and len(fake.entries()) == 1 and not fake.leftovers()


def test_a_killed_compile_leaves_nothing_once_rebuilt(fake, monkeypatch):
    monkeypatch.setenv("FAKE_NVCC_SLEEP", "30")
    child = _child(SOURCE)
    deadline = time.monotonic() + 30
    while fake.runs() == 0 and time.monotonic() < deadline:   # nvcc started: scratch exists
        time.sleep(0.05)
    assert fake.leftovers()
    child.kill()   # SIGKILL: no cleanup runs
    child.communicate()
    monkeypatch.setenv("FAKE_NVCC_SLEEP", "0")
    assert compiler.compile_source(SOURCE, "sm_90").startswith(b"\x7fELF")
    assert not fake.leftovers() and len(fake.entries()) == 1


def test_pitgen_cache_naming_a_file_is_a_clean_error_where_a_directory_is_needed(tmp_path,
                                                                                monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("PITGEN_CACHE", str(blocker))
    with pytest.raises(pitgen.FileError, match="cannot use the cache directory"):
        cache.directory("graphs")
