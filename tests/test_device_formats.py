"""CPU tests of the GPU-format layer: schedule spaces and planning (PIT rules), host-side
validation before anything reaches the GPU, the hyb bucket-order rules that the GPU layout
reproduces, template rendering, and nvcc compilation of the variants for sm_80 and sm_90."""
from __future__ import annotations

import os
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, strategies as st

from pitgen import PlanError, ShapeError, compiler
from pitgen.graph.formats import CSR, Hyb
from pitgen.graph.kernels import (GROUPS, HYB_WIDTHS, SPMM_CUT, SPMM_PACKS, SPMM_UNROLL,
                                  resolve_schedule,
                                  GRAPH_SDDMM, SPMM, default_schedule, schedule_space)
from pitgen.graph.device import hyb_atomic
from pitgen.render import render_template


@pytest.fixture(autouse=True)
def _temporary_compile_cache():
    """Compiles here must never land in the user's ~/.cache/pitgen (conftest sets a temporary
    PITGEN_CACHE; this says so if it ever does not)."""
    folder = os.environ.get("PITGEN_CACHE", "")
    assert folder and Path(folder).resolve() != (Path.home() / ".cache" / "pitgen").resolve()


# -- planning ---------------------------------------------------------------------------------

def test_rules_of_the_graph_operators():
    assert SPMM.derive() == {"rows": ("i",), "neighbours": ("j",)}
    assert GRAPH_SDDMM.derive() == {"edge rows": ("i",), "edge columns": ("j",),
                                    "features": ("f",)}


@given(st.sampled_from(["spmm", "sddmm"]), st.sampled_from(["csr", "ell", "bsr", "hyb"]),
       st.sampled_from([1, 32, 33, 64, 96, 130, 512]), st.sampled_from(["float32", "float16"]))
def test_schedule_space_is_valid_and_holds_the_default(op, fmt, feat, dtype):
    space = schedule_space(op, fmt, feat, dtype)
    assert space and default_schedule(op, fmt, feat, dtype) in space
    size = 4 if dtype == "float32" else 2
    for s in space:
        assert feat % s["vec"] == 0 and s["vec"] * size <= 16
        assert s["threads"] in (128, 256)
        groups = s["groups"] if "groups" in s else [s["group"]]
        assert ("groups" in s) == (op == "spmm" and fmt == "hyb")
        assert all(g in GROUPS for g in groups) and len(groups) in (1, HYB_WIDTHS)
        assert resolve_schedule(s, op, fmt, feat, dtype) == s
    assert len({repr(s) for s in space}) == len(space)


def test_default_schedules():
    # CSR: as many neighbours in flight as the group fetches, unroll * packs <= 8 (registers)
    assert default_schedule("spmm", "csr", 32, "float32") == {"group": 8, "vec": 4, "threads": 256,
                                                              "unroll": 8, "packs": SPMM_PACKS}
    assert default_schedule("spmm", "csr", 512, "float16") == {"group": 32, "vec": 8,
                                                              "threads": 256, "unroll": 4,
                                                              "packs": SPMM_PACKS}
    assert default_schedule("spmm", "csr", 8, "float16")["unroll"] == 4   # a group of 4 lanes
    assert default_schedule("spmm", "ell", 32, "float32")["unroll"] == SPMM_UNROLL
    assert default_schedule("spmm", "ell", 33, "float16")["vec"] == 1
    assert default_schedule("sddmm", "hyb", 32, "float32") == {"group": 4, "vec": 4,
                                                              "threads": 256}
    assert default_schedule("spmm", "hyb", 64, "float32")["groups"] == [16] * HYB_WIDTHS
    assert default_schedule("spmm", "hyb", 64, "float32")["cut"] == SPMM_CUT


def test_schedule_errors():
    with pytest.raises(PlanError, match="unknown graph operator"):
        schedule_space("gemm", "csr", 32, "float32")
    with pytest.raises(PlanError, match="unknown sparse format"):
        default_schedule("spmm", "coo", 32, "float32")
    with pytest.raises(ShapeError, match="dtype"):
        schedule_space("spmm", "csr", 32, "float64")
    with pytest.raises(ShapeError, match="feature size"):
        schedule_space("spmm", "csr", 0, "float32")
    with pytest.raises(PlanError, match="unknown"):
        resolve_schedule({"warps": 2}, "spmm", "csr", 32, "float32")
    with pytest.raises(PlanError, match="vec"):
        resolve_schedule({"vec": 8}, "spmm", "csr", 32, "float32")
    with pytest.raises(PlanError, match="unroll"):
        resolve_schedule({"unroll": 3}, "spmm", "csr", 32, "float32")
    with pytest.raises(PlanError, match="packs"):
        resolve_schedule({"packs": 8}, "spmm", "hyb", 32, "float32")
    with pytest.raises(PlanError, match="cut"):
        resolve_schedule({"cut": "sort"}, "spmm", "hyb", 32, "float32")
    with pytest.raises(PlanError, match="unknown"):   # only hyb cuts rows
        resolve_schedule({"cut": "atomic"}, "spmm", "csr", 32, "float32")
    with pytest.raises(PlanError, match="unknown"):   # SDDMM has no gather loop to unroll
        resolve_schedule({"unroll": 4}, "sddmm", "csr", 32, "float32")
    with pytest.raises(PlanError, match="groups"):
        resolve_schedule({"groups": [8, 8]}, "spmm", "hyb", 32, "float32")
    with pytest.raises(PlanError, match="threads"):
        resolve_schedule({"threads": 64}, "sddmm", "ell", 32, "float32")


def test_hyb_atomic_rule():
    assert hyb_atomic(2, 3, 1, False)  # several column parts: every bucket
    assert not hyb_atomic(1, 3, 8, False)  # no cut row: no collision
    assert hyb_atomic(1, 3, 8, True) and not hyb_atomic(1, 3, 4, True)  # cut rows: widest only


# -- host validation before the GPU ------------------------------------------------------------

@pytest.mark.parametrize("indptr,indices,what", [
    ([0, 2, 3], [1, 0, 2], "unsorted"),
    ([0, 2, 3], [1, 1, 2], "duplicate"),
    ([0, 2, 1], [0, 1], "not monotone"),
    ([0, 1, 3], [0, 1, 5], "out of range"),
    ([0, 1, 3], [0, -1, 2], "out of range"),
])
def test_bad_csr_refused_on_the_host(indptr, indices, what):
    with pytest.raises(ShapeError, match=what):
        CSR((2, 4), np.array(indptr, np.int32), np.array(indices, np.int32))


def test_mixed_index_dtypes_refused():
    with pytest.raises(ShapeError, match="mixed index dtypes"):
        CSR((2, 4), np.array([0, 1, 2], np.int64), np.array([0, 1], np.int32))


# -- the hyb order the GPU layout reproduces ---------------------------------------------------

@given(st.integers(1, 30), st.integers(1, 40), st.integers(1, 4), st.integers(0, 3),
       st.integers(0, 2**32 - 1))
def test_hyb_bucket_rows_follow_the_sort_key(rows, cols, c, k, seed):
    """The GPU numbers bucket rows by sorting (bucket = part * (k+1) + log2 width, row) and
    cutting each group into ceil(n / 2^k) consecutive pieces: the reference's order."""
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal((rows, cols)) * (rng.random((rows, cols)) < 0.3)
    csr = CSR.from_dense(dense)
    hyb = Hyb.from_csr(csr, c, k)
    part = max(1, -(-cols // c))
    counts = np.zeros((rows, c), int)
    np.add.at(counts, (csr.row_ids(), csr.indices // part), 1)
    expected = []
    for b in range(c * (k + 1)):
        p, e = divmod(b, k + 1)
        for r in range(rows):
            n = counts[r, p]
            if n and min(int(np.ceil(np.log2(n))) if n > 1 else 0, k) == e:
                expected += [(p, 1 << e, r)] * (-(-n // (1 << k)))
    got = [(bk.part, bk.width, int(r)) for bk in hyb.buckets for r in bk.row_ids]
    assert got == expected


# -- rendering and compilation -----------------------------------------------------------------

def _hyb_buckets(c: int, k: int, groups: list[int], cut: bool) -> list[dict]:
    def mode(width: int) -> str:
        return ("atomic" if c > 1 else "pieces") if hyb_atomic(c, k, width, cut) else "direct"
    return [{"width": 1 << (b % (k + 1)), "group": groups[b % (k + 1)], "packs": 1 + b % 2,
             "mode": mode(1 << (b % (k + 1)))} for b in range(c * (k + 1))]


VARIANTS = {  # name: (template, context); each compiled for one architecture below
    "convert-f32-mask": ("convert.cu.j2", {"dtype": "float32", "src_dtype": "uint8"}),
    "convert-f16": ("convert.cu.j2", {"dtype": "float16", "src_dtype": "float16"}),
    "spmm-csr-f16": ("spmm.cu.j2", {"dtype": "float16", "fmt": "csr", "vec": 8, "threads": 256,
                                    "group": 32, "unroll": 4, "packs": 2}),
    "spmm-ell-f32": ("spmm.cu.j2", {"dtype": "float32", "fmt": "ell", "vec": 1, "threads": 128,
                                    "group": 4, "unroll": 1, "packs": 1}),
    "spmm-bsr-f32": ("spmm.cu.j2", {"dtype": "float32", "fmt": "bsr", "vec": 4, "threads": 256,
                                    "group": 8, "unroll": 8, "packs": 4,
                                    "block": 16}),
    "spmm-hyb-f16": ("spmm.cu.j2", {"dtype": "float16", "fmt": "hyb", "vec": 2, "threads": 256,
                                    "unroll": 2,
                                    "buckets": _hyb_buckets(2, 3, [4, 8, 16, 32], False)}),
    "spmm-hyb-f32": ("spmm.cu.j2", {"dtype": "float32", "fmt": "hyb", "vec": 4, "threads": 128,
                                    "unroll": 4,
                                    "buckets": _hyb_buckets(1, 6, [8] * 7, True)}),
    "sddmm-bsr-f16": ("graph_sddmm.cu.j2", {"dtype": "float16", "fmt": "bsr", "vec": 8,
                                            "threads": 256, "group": 8, "block": 32}),
    # edge lists: vector atomics (float4, float2) on sm_90, scalar ones on sm_80
    "spmm-coo-f16-i64": ("spmm.cu.j2", {"dtype": "float16", "fmt": "coo", "vec": 4,
                                        "threads": 256, "idx64": True}),
    "spmm-coo-f32": ("spmm.cu.j2", {"dtype": "float32", "fmt": "coo", "vec": 4, "threads": 256,
                                    "idx64": False}),
    "spmm-coo-f32-v1": ("spmm.cu.j2", {"dtype": "float32", "fmt": "coo", "vec": 1,
                                       "threads": 256, "idx64": False}),
    "spmm-coo-f16-v2": ("spmm.cu.j2", {"dtype": "float16", "fmt": "coo", "vec": 2,
                                       "threads": 256, "idx64": False}),
}
RENDER_ONLY = {
    f"sddmm-{fmt}-{dt}": ("graph_sddmm.cu.j2", {"dtype": dt, "fmt": fmt, "vec": 2,
                                                "threads": 128, "group": 16, "block": 8})
    for fmt in ("csr", "ell", "hyb") for dt in ("float32", "float16")}
ARCH = {name: ("sm_80", "sm_90")[i % 2] for i, name in enumerate(VARIANTS)}


def test_templates_render_every_variant():
    for name, (tpl, ctx) in {**VARIANTS, **RENDER_ONLY}.items():
        src = render_template(tpl, **ctx)
        assert src == render_template(tpl, **ctx), name
        kernels = ("pit_spmm",) if tpl == "spmm.cu.j2" else \
            ("pit_sddmm",) if tpl == "graph_sddmm.cu.j2" else \
            ("pit_to_ell", "pit_bsr_fill", "pit_hyb_count", "pit_hyb_layout",
             "pit_coo_keys", "pit_coo_csr", "pit_row_stats", "pit_dense_to_csr")
        for k in kernels:
            assert f"{k}(" in src, (name, k)
    hyb = render_template(*VARIANTS["spmm-hyb-f32"][0:1], **VARIANTS["spmm-hyb-f32"][1])
    # one fused launch, one body per bucket; atomics only in the widest bucket (cut rows)
    assert hyb.count("hyb_bucket<") == 7
    assert "hyb_bucket<64, 8, 1, PIECES>" in hyb and "hyb_bucket<32, 8, 2, DIRECT>" in hyb
    f16 = render_template(*VARIANTS["spmm-hyb-f16"][0:1], **VARIANTS["spmm-hyb-f16"][1])
    assert f16.count(", ATOMIC>(") == 8 and "pit_spmm_finish(" in f16   # c = 2: all parts add


def nvcc_jobs(pool) -> dict[str, Future]:
    """Each variant's compile for its arch, by name (submitted at collection by conftest)."""
    return {name: pool.submit(compiler.compile_source, render_template(tpl, **ctx), ARCH[name])
            for name, (tpl, ctx) in VARIANTS.items()}


@pytest.mark.nvcc
def test_variants_compile_for_sm80_and_sm90(nvcc):
    errors = [f"{name} ({ARCH[name]}): {job.exception()}"   # every failure, not only the first
              for name, job in nvcc_jobs(nvcc).items() if job.exception()]
    assert not errors, "\n".join(errors)


def test_kernel_signatures_match_the_templates_parameters():
    """Each graph kernel's launch signature has one letter per parameter of the rendered kernel
    (P pointer, q 64-bit integer, i 32-bit): a wrong letter packs the arguments at the wrong
    offsets, which no CPU launch would show."""
    import re

    from pitgen.graph.device import CONVERT, TRANSPOSE
    from pitgen.graph.kernels import COO_SPMM, HYB_SPMM
    ctx = {name: c for name, (_, c) in VARIANTS.items()}
    cases = [(SPMM, ctx["spmm-csr-f16"]), (HYB_SPMM, ctx["spmm-hyb-f32"]),
             (COO_SPMM, ctx["spmm-coo-f16-i64"]), (GRAPH_SDDMM, ctx["sddmm-bsr-f16"]),
             (CONVERT, ctx["convert-f16"]), (TRANSPOSE, {})]
    for spec, context in cases:
        src = spec.source(context)
        for kernel, sig in spec.kernels.items():
            params = re.search(rf"\b{kernel}\(([^)]*)\)", src).group(1).split(",")
            kinds = "".join("P" if "*" in p else "q" if "long long" in p else "i" for p in params)
            assert kinds == sig, (spec.name, kernel, kinds, sig)


def test_programmatic_launch_reaches_the_driver_as_cuda_h_numbers_it():
    """The kernels behind an index pass go out as programmatic dependents through
    cuLaunchKernelEx with one attribute: a wrong id would launch a grid that starts before its
    input is written, and no CPU launch would show it."""
    import ctypes

    from pitgen import runtime

    seen = []

    class Lib:
        def cuModuleGetFunction(self, *args): return 0
        def cuFuncGetAttribute(self, *args): return 0

        def cuLaunchKernelEx(self, ref, handle, params, extra):
            cfg = ctypes.cast(ref, ctypes.POINTER(runtime._LaunchConfig)).contents
            seen.append((tuple(cfg.grid), tuple(cfg.block), cfg.smem, cfg.nattrs,
                         cfg.attrs[0].id, cfg.attrs[0].value, cfg.stream))
            return 0

    class Mod:
        _lib = Lib()
        handle = None

    kernel = runtime._Kernel(Mod(), "k", "Pi")
    kernel.bind((5,), (128,), 1024, early=True)(9, 0, 3)
    kernel.bound_early((660,), (256,), 0)(7, 0, 3)
    assert seen == [((5, 1, 1), (128, 1, 1), 1024, 1, 6, 1, 9),
                    ((660, 1, 1), (256, 1, 1), 0, 1, 6, 1, 7)]
    assert kernel.bound_early((660,), (256,), 0) is kernel.bound_early((660,), (256,), 0)
