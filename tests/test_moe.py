"""CPU tests of the MoE layer: the NumPy routing index and layer references, plan decisions
(rules, tiles, upper bounds, refusals), rendering, and nvcc compilation of the template's
variants for sm_80 and sm_90. No torch or GPU needed."""
from __future__ import annotations

import dataclasses
import re
from concurrent.futures import Future

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pitgen import reference as R
import pitgen
import pitgen.ops.moe as moe
from pitgen import opspec
from pitgen.opspec import Permutation
from pitgen import compiler
from pitgen.runtime import compile_target
from pitgen.errors import PlanError, RuleError, ShapeError

@settings(max_examples=40, deadline=None)
@given(T=st.integers(0, 300), topk=st.integers(1, 3), E=st.integers(1, 40),
       bm=st.sampled_from([64, 128]), seed=st.integers(0, 2**16))
def test_route_reference_invariants(T, topk, E, bm, seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(-2, E + 2, size=(T, topk))
    r = R.route_reference(ids, E, bm)
    valid = (ids >= 0) & (ids < E)
    assert r.counts.sum() == valid.sum() and r.offsets[-1] == valid.sum()
    assert np.array_equal(np.diff(r.offsets), r.counts)
    flat = ids.reshape(-1)
    for e in range(E):   # each segment lists exactly the pairs routed to e
        seg = r.row_pair[r.offsets[e]:r.offsets[e + 1]]
        assert np.array_equal(np.sort(seg), np.flatnonzero(flat == e))
    # tiles: ceil(count / bm) per expert, consecutive row starts, within the upper bound
    assert len(r.tile_e) == sum(-(-c // bm) for c in r.counts)
    plan_bound = -(-T * topk // bm) + E
    assert len(r.tile_e) <= plan_bound
    for e, r0 in zip(r.tile_e, r.tile_r):
        assert r.offsets[e] <= r0 < r.offsets[e + 1] and (r0 - r.offsets[e]) % bm == 0


def test_routing_empty_and_one_expert():
    r = R.route_reference(np.full((70, 1), 2), 4, 64)
    assert r.counts.tolist() == [0, 0, 70, 0]
    assert r.tile_e.tolist() == [2, 2] and r.tile_r.tolist() == [0, 64]
    r = R.route_reference(np.full((5, 2), 9), 4, 64)   # every id out of range
    assert r.counts.sum() == 0 and len(r.tile_e) == 0 and len(r.row_pair) == 0


@pytest.mark.parametrize("act", moe.ACTIVATIONS)
def test_layer_reference_matches_dense_formula(act):
    """Routing-based reference == the dense definition sum_j g * FFN_e(x) computed per token."""
    rng = np.random.default_rng(1)
    T, topk, E, H, F = 23, 2, 5, 8, 16
    x = rng.standard_normal((T, H))
    ids = rng.integers(0, E, (T, topk))
    ids[3, 1] = E      # skipped
    g = rng.random((T, topk))
    w1, w2 = rng.standard_normal((E, H, F)), rng.standard_normal((E, F, H))
    b1, b2 = rng.standard_normal((E, F)), rng.standard_normal((E, H))
    y = R.moe_reference(x, ids, g, w1, w2, b1, b2, act)
    f = {"relu": lambda v: np.maximum(v, 0), "identity": lambda v: v,
         "silu": lambda v: v / (1 + np.exp(-v)),
         "gelu": lambda v: 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3)))}[act]
    want = np.zeros((T, H))
    for t in range(T):
        for j in range(topk):
            e = ids[t, j]
            if 0 <= e < E:
                want[t] += g[t, j] * (f(x[t] @ w1[e] + b1[e]) @ w2[e] + b2[e])
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)


def test_gelu_reference_is_close_to_exact_gelu():
    from math import erf, sqrt
    v = np.linspace(-6, 6, 101)
    exact = np.array([0.5 * a * (1 + erf(a / sqrt(2))) for a in v])
    assert np.abs(R.activation_reference(v, "gelu") - exact).max() < 1e-3


def test_plan_decisions():
    p = moe.plan_moe(4096, 1, 64, 768, 3072)
    assert (p.bm, p.bn, p.bk, p.stages, p.threads) == (64, 128, 32, 4, 256)
    assert p.max_tiles == 4096 // 64 + 64
    assert p.gemm_grid(3072) == (128, 24, 1) and p.gemm_grid(768) == (128, 6, 1)
    assert p.smem == 4 * (64 * 40 + 32 * 136) * 2 and p.smem <= 227 * 1024
    big = moe.plan_moe(8192, 2, 8, 1024, 4096, "bfloat16", "silu", "int64")
    assert big.bm == 128 and big.id_type == "long long" and big.smem <= 227 * 1024
    f32 = moe.plan_moe(100, 1, 4, 64, 64, "float32")
    assert f32.vec == 4 and f32.smem == 3 * (64 * 36 + 32 * 132) * 4
    assert moe.plan_moe(1, 1, 1, 8, 8).max_tiles == 2
    assert moe.weight_bytes(64, 768, 3072) == 2 * 64 * 768 * 3072 * 2


def test_hopper_plan_decisions():
    """sm_90: fp16/bf16 batches past one routing block take the wgmma kernels (persistent: one
    CTA per SM at most); fp32 and decode-sized batches keep mma.sync."""
    p = moe.plan_moe(4096, 1, 64, 768, 3072, arch="sm_90")
    assert (p.mainloop, p.bm, p.bn, p.bk, p.stages, p.threads) == ("wgmma", 128, 128, 64, 6, 384)
    assert p.smem <= 227 * 1024 and p.context()["mainloop"] == "wgmma"
    assert p.gemm_grid(3072, 132) == (132, 1, 1) and p.gemm_grid(768, 1000) == (p.max_tiles * 6, 1, 1)
    assert moe.plan_moe(4096, 1, 64, 768, 3072).mainloop == "mma_sync"   # sm_80
    assert moe.plan_moe(4096, 1, 64, 768, 3072, "float32", arch="sm_90").mainloop == "mma_sync"
    assert moe.plan_moe(256, 1, 64, 768, 3072, arch="sm_90").mainloop == "mma_sync"
    assert moe.plan_moe(129, 2, 64, 768, 3072, "bfloat16", arch="sm_90").mainloop == "wgmma"


def test_plan_uses_the_rules(monkeypatch):
    """The plan asks the rule engine about t; an expression where t is not invariant is refused."""
    bad = Permutation("tokens in", "I[t,f] += X[t+f,h] * W1[h,f]", "spatial", "X")
    monkeypatch.setattr(opspec, "OPERATORS", dict(opspec.OPERATORS))  # the copy registers it
    monkeypatch.setattr(moe, "MOE", dataclasses.replace(moe.MOE, name="moe (t+f)",
                                                        permutes=(bad,)))
    moe.plan_moe.cache_clear()
    with pytest.raises(RuleError, match="not permutation invariant"):
        moe.plan_moe(16, 1, 2, 8, 8)


@pytest.mark.parametrize("kw,err,msg", [
    (dict(hidden=12), ShapeError, "multiple of 8"),
    (dict(ffn=0), ShapeError, "multiple of 8"),
    (dict(dtype="float64"), ShapeError, "float64"),
    (dict(activation="tanh"), PlanError, "tanh"),
    (dict(id_dtype="int16"), ShapeError, "int16"),
    (dict(topk=0), ShapeError, "topk"),
    (dict(tokens=2**31), ShapeError, "too large"),
])
def test_plan_refuses(kw, err, msg):
    args = dict(tokens=64, topk=1, experts=4, hidden=64, ffn=64)
    args.update(kw)
    with pytest.raises(err, match=msg):
        moe.plan_moe(**args)


def test_float32_allows_multiples_of_4():
    assert moe.plan_moe(10, 1, 2, 12, 20, "float32").vec == 4


def test_signatures_match_kernel_parameters():
    """Every PyCUDA signature has one letter per parameter of its kernel in the rendered source
    of one mainloop or the other (the wgmma module leaves the mma.sync GEMMs out, and back)."""
    srcs = [moe.MOE.source(moe.plan_moe(4096, 2, 4, 64, 64, arch=a).context())
            for a in ("sm_80", "sm_90")]
    wgmma = {"moe_place_gather", "moe_gemm1_sm90", "moe_gemm2_sm90"}
    for name, sig in moe.MOE.kernels.items():
        found = [re.search(r"\b" + name + r"\(([^)]*)\)", src) for src in srcs]
        assert [m is not None for m in found] == (
            [False, True] if name in wgmma else
            [True, name not in ("moe_gemm1", "moe_gemm1_routed", "moe_gemm2", "moe_small")]), name
        params = [p.strip() for p in next(m for m in found if m).group(1).split(",")]
        assert len(params) == len(sig), name
        for p, c in zip(params, sig):
            if c == "P":
                assert "*" in p, (name, p)
            elif c == "i":
                assert p.startswith("int "), (name, p)
            elif c == "M":
                assert "CUtensorMap" in p, (name, p)
            else:
                assert p.startswith("long long "), (name, p)


def test_backward_signatures_match_kernel_parameters():
    """moe_rows_nn / _nt / _act, moe_wgrad and moe_gather: one signature letter per parameter,
    in order."""
    src = moe.MOE_BACKWARD.source(moe.BackwardPlan("float16").context())
    for name, sig in moe.MOE_BACKWARD.kernels.items():
        params = [p.strip() for p in re.search(r"\b" + name + r"\(([^)]*)\)", src)
                  .group(1).split(",")]
        assert len(params) == len(sig), name
        for p, c in zip(params, sig):
            assert ("*" in p) if c == "P" else p.startswith("int "), (name, p)
    assert moe.MOE_BACKWARD.derive() == {"tile rows": ("t",), "expert rows": ("r",)}
    assert moe.BackwardPlan("float16").smem <= 227 * 1024
    assert "bf16.bf16" in moe.MOE_BACKWARD.source(moe.BackwardPlan("bfloat16").context())


def test_render_variants():
    src = moe.MOE.source(moe.plan_moe(64, 1, 4, 64, 64, "bfloat16", "silu", "int64").context())
    assert "typedef long long eid_t;" in src and "__nv_bfloat16 elem_t" in src
    assert "__expf" in src and "BM = 64" in src
    src = moe.MOE.source(moe.plan_moe(64, 1, 4, 64, 64, "float32", "identity").context())
    assert "tf32" in src and "return v;" in src


def test_import_without_torch_and_lazy_module():
    assert "torch" not in moe.__dict__
    with pytest.raises(AttributeError):
        moe.NotThere  # noqa: B018
    assert isinstance(pitgen.ops.moe.ACTIVATIONS, tuple)


VARIANTS = [("float16", "gelu", "int32", 4096, "sm_90"), ("float16", "relu", "int64", 4096, "sm_80"),
            ("bfloat16", "silu", "int64", 100000, "sm_90"), ("bfloat16", "identity", "int32", 64, "sm_80"),
            ("float32", "gelu", "int32", 64, "sm_90"), ("float32", "silu", "int64", 100000, "sm_80"),
            ("float16", "silu", "int32", 200, "sm_90")]


def _plans() -> list[moe.MoEPlan]:
    return [moe.plan_moe(T, 1, 8, 64, 128, dtype, act, ids, arch)
            for dtype, act, ids, T, arch in VARIANTS]


#: the backward kernels' module: both dtypes, both architectures, every activation
BACKWARD_VARIANTS = [("float16", "gelu", "sm_80"), ("bfloat16", "silu", "sm_90"),
                     ("float16", "relu", "sm_90"), ("bfloat16", "identity", "sm_80")]


def nvcc_jobs(pool) -> list[Future]:
    """Each variant's compile for its arch (submitted at collection by conftest): the layer's
    modules, then the backward's."""
    return [pool.submit(compiler.compile_source, moe.MOE.source(plan.context()),
                        compile_target(v[-1])) for plan, v in zip(_plans(), VARIANTS)] + [
        pool.submit(compiler.compile_source,
                    moe.MOE_BACKWARD.source(moe.BackwardPlan(dtype, act).context()),
                    compile_target(arch)) for dtype, act, arch in BACKWARD_VARIANTS]


@pytest.mark.nvcc
def test_compile_variants(nvcc):
    """Every dtype and activation, both id types, both tile heights and both mainloops compile
    for sm_80 / sm_90a (wgmma: fp16 and bf16 past one routing block; mma.sync on sm_90a for
    fp32 and decode-sized batches)."""
    plans = _plans()
    assert {p.bm for p in plans if p.mainloop == "mma_sync"} == {64, 128}
    assert [p.mainloop for p in plans].count("wgmma") == 2
    jobs = nvcc_jobs(nvcc)
    assert len(jobs) == len(VARIANTS) + len(BACKWARD_VARIANTS)
    assert all(len(job.result()) > 1000 for job in jobs)
