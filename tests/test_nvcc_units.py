"""The compile units of the nvcc tests (tests/nvcc_units.py) judge each source as nvcc alone
would: sources that share kernel and macro names compile together and the unit's cubin holds
each one's kernels; a source that fails alone fails with its own error (a macro of the source
before it does not leak into it) while the others pass; a unit that fails although each of its
sources compiles alone is reported. Units group sources of equal headers, within the limits,
largest first."""
from __future__ import annotations

import re
from concurrent.futures import Future

import nvcc_units as U
import pytest

import pitgen
from pitgen.bench.probe import PROBE

#: One kernel name and the same macros (PIECE_VECS, LOADS) in both.
PROBES = tuple(PROBE.source({"piece": piece, "loads": 4}) for piece in (256, 128))
#: Uses a macro that the probes define: it does not compile alone.
LEAK = """#include <stdint.h>
extern "C" __global__ void k(int* x) { *x = PIECE_VECS; }
"""
#: Compiles alone, not in a unit (there its global variable is in the unit's namespace).
QUALIFIED = """#include <stdint.h>
__device__ int v;
extern "C" __global__ void k(int* x) { *x = ::v; }
"""
#: An ``extern "C"`` name that is not a kernel: it cannot be renamed, so it compiles alone.
DEVICE_FUNCTION = """#include <stdint.h>
extern "C" __device__ int f(int x) { return x; }
"""
#: Other headers than the rest.
HALF = """#include <cuda_fp16.h>
extern "C" __global__ void k(__half* x) { *x = 0.0f; }
"""


def nvcc_jobs(pool) -> list[Future]:
    """A unit of the probes, one with a leaking macro, one that fails only as a unit."""
    return [pool.submit(U.compile_unit, sources, "sm_80")
            for sources in (PROBES, (PROBES[0], LEAK), (PROBES[0], QUALIFIED))]


def test_units_group_equal_headers_within_the_limits_largest_first(monkeypatch):
    monkeypatch.setattr(U, "MAX_SOURCES", 2)
    sources = [*PROBES, LEAK, QUALIFIED, DEVICE_FUNCTION, HALF]
    units = U.plan(sources)
    assert sorted(s for unit in units for s in unit) == sorted(sources)
    assert all(len(unit) <= 2 and len({U.headers(s) for s in unit}) == 1 for unit in units)
    assert [DEVICE_FUNCTION] in units and not U.fits(DEVICE_FUNCTION) and U.fits(PROBES[0])
    sizes = [sum(map(len, unit)) for unit in units]
    assert sizes == sorted(sizes, reverse=True)
    monkeypatch.setattr(U, "MAX_CHARS", len(PROBES[0]))
    assert [PROBES[0]] in U.plan(PROBES) and [PROBES[1]] in U.plan(PROBES)


@pytest.mark.nvcc
def test_a_unit_judges_each_source_as_nvcc_alone(nvcc):
    together, leaking, qualified = (job.result() for job in nvcc_jobs(nvcc))
    (cubin, same), split = together
    assert cubin is same and split is None
    assert all(re.search(rb"[\0.]pit_gather_probe_unit%d\0" % i, cubin) for i in (0, 1))
    (probe, leak), split = leaking
    assert probe[:4] == b"\x7fELF" and split is None
    assert isinstance(leak, pitgen.CompileError) and "PIECE_VECS" in str(leak)
    outcomes, split = qualified
    assert all(o[:4] == b"\x7fELF" for o in outcomes) and outcomes[0] is not outcomes[1]
    assert split is not None and "nvcc failed" in split
