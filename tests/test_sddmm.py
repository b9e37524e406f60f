"""CPU tests of SDDMM and sparse training: float64 NumPy references (tile index, tile values,
the gradient formulas of both autograd Functions against finite differences), planning, rule
derivation, rendering, and nvcc compilation of the SDDMM variants, alternately for sm_80 and
sm_90."""
from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pitgen import reference as R
from pitgen import testing as T
import pitgen
from pitgen import compiler
from pitgen.ops import linear as autograd
from pitgen.ops import sddmm
from pitgen.render import render_template

ARCHS = ("sm_80", "sm_90")

def brute_index(mask: np.ndarray, th: int, tw: int) -> set[tuple[int, int]]:
    M, N = mask.shape
    return {(r, c) for r in range(-(-M // th)) for c in range(-(-N // tw))
            if mask[r * th:(r + 1) * th, c * tw:(c + 1) * tw].any()}


@settings(max_examples=25, deadline=None)
@given(m=T.masks(max_side=70), D=st.integers(1, 9),
       tile=st.sampled_from([(32, 1), (1, 32), (16, 16), (64, 8), (1, 16)]), seed=st.integers(0, 2**31))
def test_reference_index_and_tiles_agree_with_brute_force(m, D, tile, seed):
    rng = np.random.default_rng(seed)
    mask = m.array
    M, N = mask.shape
    q, k = rng.standard_normal((M, D)), rng.standard_normal((N, D))
    th, tw = tile
    assert R.sddmm_index_reference(mask, tile) == brute_index(mask, th, tw)
    s = R.sddmm_reference(q, k, mask, scale=0.25)
    for (i, j) in np.ndindex(M, N):
        want = 0.25 * float(q[i] @ k[j]) if mask[i, j] else 0.0
        assert s[i, j] == pytest.approx(want, abs=1e-12)
    rebuilt = np.zeros((-(-M // th) * th, -(-N // tw) * tw))
    for (r, c), v in R.sddmm_tiles_reference(q, k, mask, tile, 0.25).items():
        assert v.shape == tile
        rebuilt[r * th:(r + 1) * th, c * tw:(c + 1) * tw] = v
    assert np.array_equal(rebuilt[:M, :N], s)
    assert not rebuilt[M:].any() and not rebuilt[:, N:].any()


def test_tiles_are_refused_with_the_reason():
    for bad in [(3, 5), (1, 1), (32, 3), (2, 32), "32x1", (32,)]:
        with pytest.raises(pitgen.PlanError, match="tile"):
            sddmm.normalise_tile(bad)
    with pytest.raises(pitgen.ShapeError, match="dtype"):
        sddmm.plan_sddmm("float64", (32, 1), (64, 1), (64, 1), (64, 1))


def test_plan_transposes_row_tiles_and_follows_the_layouts():
    row = sddmm.plan_sddmm("float16", (1, 32), (1, 100), (64, 1), (50, 1))
    assert row.transposed and (row.th, row.tw) == (32, 1)
    # transposed: q and k swap, so k's layout (d contiguous) is now the first operand's
    assert row.q_dfast and not row.k_dfast
    assert row.strategy == "warp" and not row.lanes_along_cols  # mask columns are rows now
    col = sddmm.plan_sddmm("float16", (32, 1), (1, 100), (64, 1), (50, 1))
    assert not col.transposed and col.strategy == "thread" and not col.q_dfast and col.k_dfast
    blk = sddmm.plan_sddmm("bfloat16", (64, 64), (64, 1), (64, 1), (1, 80))
    assert blk.strategy == "warp" and not blk.lanes_along_cols
    g = sddmm.grid_of(col, 100, 130)
    assert g == {"index": (1, 4, 1), "tiles": (4, 3, 1)}
    with pytest.raises(pitgen.ShapeError, match="tiles"):
        sddmm.grid_of(col, 32 * 70000, 8)


def test_the_operator_is_derived_through_the_rules():
    rules = pitgen.analyse(sddmm.EXPR)
    assert {"i", "j", "d"} <= set(rules.invariant_axes())
    assert sddmm.SDDMM.derive() == {"rows": ("i",), "columns": ("j",)}
    # the linear layer's kernels: micro-tiles only along axes the rules let the planner permute
    pitgen.plan(autograd.WEIGHT_FORWARD, "A", micro_tile="32x1")   # k: in features, reduced in yᵀ
    pitgen.plan(autograd.WEIGHT_DX, "B", micro_tile="32x1")        # n: in-features of dX
    pitgen.plan(autograd.INPUT_DW, "B", micro_tile="1x64")         # k: the batch, reduced in dW
    with pytest.raises(pitgen.RuleError, match="not a single permutation invariant axis"):  # y+r
        pitgen.plan("O[n,f,y] += I[n,c,y+r] * W[f,c,r]", "I", micro_tile="4x8x1")
    with pytest.raises(pitgen.PlanError, match="micro"):
        pitgen.plan(autograd.WEIGHT_FORWARD, "A", micro_tile="32x1x1")


# -- the gradient formulas the Functions implement, against finite differences ------------------

def _loss(x, w, b, m, g):
    """<g, x (w ⊙ m)ᵀ + b>: its gradients are the backward formulas with dY = g."""
    return float(np.sum(g * (x @ (w * m).T + b)))


@settings(max_examples=10, deadline=None)
@given(batch=st.integers(1, 6), in_f=st.integers(1, 6), out_f=st.integers(1, 6),
       seed=st.integers(0, 2**31))
def test_gradient_formulas_match_finite_differences(batch, in_f, out_f, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, in_f)) * (rng.random((batch, in_f)) < 0.5)  # ReLU-like zeros
    w, b = rng.standard_normal((out_f, in_f)), rng.standard_normal(out_f)
    m = rng.random((out_f, in_f)) < 0.5
    g = rng.standard_normal((batch, out_f))
    # weight sparsity: dX = dY W_eff, dW = (dYᵀ X) ⊙ M (the SDDMM), db = Σ dY
    dx = g @ (w * m)
    dw = R.sddmm_reference(g.T, x.T, m)
    db = g.sum(0)
    # activation sparsity: the same formulas with M all ones (dX dense: dY W)
    ones = np.ones_like(m)
    eps = 1e-6
    for arr, grad, name in ((x, dx, "x"), (w, dw, "w"), (b, db, "b")):
        for idx in np.ndindex(arr.shape):
            plus, minus = arr.copy(), arr.copy()
            plus[idx] += eps
            minus[idx] -= eps
            args = {"x": x, "w": w, "b": b, name: plus}
            lp = _loss(args["x"], args["w"], args["b"], m, g)
            args[name] = minus
            lm = _loss(args["x"], args["w"], args["b"], m, g)
            assert (lp - lm) / (2 * eps) == pytest.approx(grad[idx], abs=1e-6)
    assert np.all(dw[~m] == 0)
    assert np.allclose(R.sddmm_reference(g.T, x.T, ones), g.T @ x)


def test_autograd_imports_without_torch_and_names_its_classes():
    assert callable(autograd.sparse_weight_linear) and callable(autograd.sparse_input_linear)
    with pytest.raises(AttributeError):
        autograd.NoSuchThing  # noqa: B018
    assert autograd._micro((32, 1)) == "32x1" and autograd._micro("auto") == "auto"


# -- rendering and compilation --------------------------------------------------------------------

VARIANTS = [("float16", (32, 1), (256, 1), (256, 1), (8, 8)),     # thread index, 16-byte loads
            ("bfloat16", (1, 32), (1, 512), (1, 384), (1, 1)),  # transposed, row-contiguous loads
            ("float32", (64, 64), (256, 1), (1, 512), (4, 1)),  # blocks, tf32
            ("float16", (16, 8), (1, 512), (256, 1), (1, 1))]   # one warp row, narrow tiles
#: the tiles on wgmma (sm_90a only): each accumulator width TH (16, 32, 64) once
WGMMA_VARIANTS = [("float16", (32, 1), (256, 1), (256, 1), (8, 8)),
                  ("bfloat16", (1, 16), (384, 1), (256, 1), (8, 8)),
                  ("float16", (64, 8), (256, 1), (512, 1), (8, 8))]


def test_vector_loads_only_where_the_layout_allows():
    assert sddmm.vector_width("float16", 64, (64, 1), 256) == 8
    assert sddmm.vector_width("float32", 64, (64, 1), 256) == 4
    assert sddmm.vector_width("float16", 60, (64, 1), 256) == 1   # D not a multiple
    assert sddmm.vector_width("float16", 64, (1, 64), 256) == 1   # d not contiguous
    assert sddmm.vector_width("float16", 64, (68, 1), 256) == 1   # rows misaligned
    assert sddmm.vector_width("float16", 64, (64, 1), 258) == 1   # base misaligned
    cfg = sddmm.plan_sddmm("float16", (1, 32), (64, 1), (1, 64), (64, 1), (8, 1))
    assert (cfg.q_vec, cfg.k_vec) == (1, 8)                        # swapped with the operands


def _sources(variants=VARIANTS, arch: str = "sm_80") -> list[str]:
    out = []
    for dtype, tile, qs, ks, vecs in variants:
        cfg = sddmm.plan_sddmm(dtype, tile, qs, ks, (384, 1), vecs, arch)
        out.append(render_template("sddmm.cu.j2", **cfg.context()))
    return out


def test_hopper_plans_multiply_on_wgmma_where_both_operands_load_16_bytes():
    for dtype, tile, qs, ks, vecs in WGMMA_VARIANTS:
        cfg = sddmm.plan_sddmm(dtype, tile, qs, ks, (384, 1), vecs, "sm_90")
        assert cfg.wgmma and cfg.smem == sddmm.WGMMA_STAGES * (64 + cfg.th) * 128 + 1024
        assert not sddmm.plan_sddmm(dtype, tile, qs, ks, (384, 1), vecs, "sm_80").wgmma
    assert not sddmm.plan_sddmm("float32", (32, 1), (256, 1), (256, 1), (384, 1), (4, 4),
                                "sm_90").wgmma                   # tf32 stays on mma.sync
    assert not sddmm.plan_sddmm("float16", (32, 1), (1, 512), (256, 1), (384, 1), (1, 8),
                                "sm_90").wgmma                   # a strided Q view too
    srcs = _sources(WGMMA_VARIANTS, "sm_90")
    assert len(set(srcs)) == len(srcs)
    for s, n in zip(srcs, (32, 16, 64)):
        assert f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32" in s and "mma_tile(acc" not in s


def test_render_names_both_kernels_and_differs_per_variant():
    srcs = _sources()
    assert len(set(srcs)) == len(srcs)
    for s in srcs:
        assert 'extern "C" __global__' in s and "pit_sddmm_index" in s and "pit_sddmm_tiles" in s
    assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32" in srcs[2]
    assert "bf16.bf16" in srcs[1]


def nvcc_jobs(pool, archs=ARCHS) -> list[Future]:
    """Each variant's compile, alternately for each arch, for both where the code depends on the
    arch (submitted at collection by conftest)."""
    jobs = [pool.submit(compiler.compile_source, src, arch) for i, src in enumerate(_sources())
            for arch in (ARCHS if "__CUDA_ARCH__" in src else ARCHS[i % 2:][:1]) if arch in archs]
    if "sm_90" in archs:
        jobs += [pool.submit(compiler.compile_source, src, "sm_90a")
                 for src in _sources(WGMMA_VARIANTS, "sm_90")]
    return jobs


@pytest.mark.nvcc
@pytest.mark.parametrize("arch", ARCHS)
def test_every_sddmm_variant_compiles(arch, nvcc):
    cubins = [job.result() for job in nvcc_jobs(nvcc, [arch])]
    assert all(c[:4] == b"\x7fELF" for c in cubins)
