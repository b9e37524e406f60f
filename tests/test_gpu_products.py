"""GPU tests of the products kernel (1 x tk micro-tiles along m at high sparsity,
gemm_products.cu.j2) against float64 references: every M from 1 to 65 and a few past the list
capacity, K not a multiple of the k-tile, odd N, empty / sparse / full masks (full: more products
than slots, so the finishing pass recomputes the rest), accumulation, B' either way round, C'
transposed, one launcher reused across masks (its row table cleared by each finishing pass), and
fresh index buffers. Outputs are poisoned with NaN: every element must be written."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pitgen
from pitgen import testing as T
from pitgen.errors import PlanError
from pitgen.lower import Schedule, gemm_form
from pitgen.operands import as_operand
from pitgen.ops.matmul import GemmCall, Launcher

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="GPU tests need torch")

EXPR = {"B": "C[m,n] += A[m,k] * B[k,n]", "Bt": "C[m,n] += A[m,k] * B[n,k]"}


def launcher(a, b, out, tk: int, dtype: str, form: str = "B", accumulate: bool = False,
             mask=None) -> Launcher:
    op = pitgen.parse(EXPR[form])
    ops = {"A": as_operand("A", a), "B": as_operand("B", b)}
    L = Launcher(op, gemm_form(op, "A"), [("micro", "m", (1, tk))], dtype, ops,
                 as_operand("out", out), accumulate, Schedule(rows="products"),
                 mask=as_operand("mask", mask) if mask is not None else None)
    assert L.spec.gemm.a_mode == "products", L.spec.gemm
    return L


def operands(rng, M: int, N: int, K: int, tk: int, kind: str, dtype: str, density: float = 0.05,
             form: str = "B"):
    mask = T.granular_mask(rng, (M, K), kind, (1, tk), density)
    a = (rng.standard_normal((M, K)) * mask).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    dt = getattr(torch, dtype)
    ta = torch.from_numpy(a).to("cuda", dt)
    tb = torch.from_numpy(b if form == "B" else np.ascontiguousarray(b.T)).to("cuda", dt)
    return mask, ta, tb, ta.double().cpu().numpy() @ torch.from_numpy(b).to(dt).double().numpy()


def check(out, ref, dtype, a, b_kn) -> None:
    T.assert_close(out, ref, dtype, scale=T.term_scale(np.matmul, a, b_kn))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_products_every_m_to_65_and_past_the_list(dtype):
    """One launcher per (M, K, tk) shape; three masks each through the launcher's reused buffers
    and once through fresh ones; accumulating, rows without products keep their bits."""
    rng = np.random.default_rng(31)
    N = 45
    for K, tk in ((72, 64), (200, 32), (136, 128)):
        for M in (*range(1, 66), 127, 129, 300):
            for i, kind in enumerate(("micro", "empty", "full")):
                mask, a, b, ref = operands(rng, M, N, K, tk, kind, dtype, 0.3)
                out = T.poison(torch.empty((M, N), dtype=a.dtype, device="cuda"))
                L = launcher(a, b, out, tk, dtype)
                assert GemmCall(L, a, b, out, reuse=i % 2 == 0).run() is out
                check(out, ref, dtype, a, b)
                base = torch.randn(M, N, device="cuda").to(a.dtype)
                acc = base.clone()
                La = launcher(a, b, acc, tk, dtype, accumulate=True)
                GemmCall(La, a, b, acc, reuse=True).run()
                base64 = base.double().cpu().numpy()
                T.assert_close(acc, ref + base64, dtype, scale=np.sqrt(
                    T.term_scale(np.matmul, a, b) ** 2 + base64 ** 2))
                idle = torch.from_numpy(~mask.any(axis=1)).cuda()
                assert torch.equal(acc[idle], base[idle]), (M, K, kind)


# eight items, so that the thorough profile's 2000 examples spread over eight workers
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("form", sorted(EXPR))
@pytest.mark.parametrize("accumulate", [False, True])
@settings(max_examples=T.examples(4, share=8), deadline=None,   # 8 items
          suppress_health_check=list(HealthCheck))
@given(M=st.one_of(st.integers(1, 130), st.sampled_from([300, 700])), N=st.integers(1, 300),
       K=st.integers(1, 80).map(lambda k: 8 * k), tk=st.sampled_from([32, 64, 128, 256]),
       density=st.sampled_from([0.0, 0.005, 0.02, 0.3, 1.0]), seed=st.integers(0, 2**31 - 1))
def test_products_kernel_matches_float64_reference(dtype, form, accumulate, M, N, K, tk, density,
                                                   seed):
    """Drawn shapes (M past the 64-row items, K a multiple of 8 but not of the k-tile, any N),
    k-tiles of 32 to 256, masks from empty to full (full: more products than slots), B' either
    way round, accumulating or into a poisoned output."""
    rng = np.random.default_rng(seed)
    _, a, b, ref = operands(rng, M, N, K, tk, "micro", dtype, density, form)
    b_kn = b if form == "B" else b.t()
    if accumulate:
        out = torch.randn(M, N, device="cuda").to(a.dtype)
        base = out.double().cpu().numpy()
        ref, scale = ref + base, np.sqrt(T.term_scale(np.matmul, a, b_kn) ** 2 + base ** 2)
    else:
        out, scale = T.poison(torch.empty((M, N), dtype=a.dtype, device="cuda")), \
            T.term_scale(np.matmul, a, b_kn)
    L = launcher(a, b, out, tk, dtype, form, accumulate)
    assert GemmCall(L, a, b, out, reuse=bool(seed % 2)).run() is out
    T.assert_close(out, ref, dtype, scale=scale)


@pytest.mark.parametrize("form,N", [("B", 256), ("Bt", 264)])
def test_products_one_launcher_across_masks(form, N):
    """Back-to-back calls of one launcher on masks that change every call (sparse, full, empty,
    rows of one product, rows of many) each give their own product: the finishing pass leaves
    the row table clear for the next call (and, N a multiple of 32, drops the slots' L2 lines
    it has read, which the next call writes again). Built from a bool mask as well as from the
    values."""
    rng = np.random.default_rng(32)
    M, K, tk = 600, 1024, 64
    mask, a, b, _ = operands(rng, M, N, K, tk, "micro", "float16", form=form)
    out = torch.empty((M, N), dtype=torch.float16, device="cuda")
    L = launcher(a, b, out, tk, "float16", form)
    b_kn = b if form == "B" else b.t()
    for i, density in enumerate((0.01, 1.0, 0.0, 0.002, 0.05, 0.3, 0.01)):
        mask = T.granular_mask(rng, (M, K), "micro", (1, tk), density)
        a.copy_(torch.from_numpy((rng.standard_normal((M, K)) * mask).astype(np.float32)))
        ref = a.double().cpu().numpy() @ b_kn.double().cpu().numpy()
        T.poison(out)
        GemmCall(L, a, b, out, reuse=True).run()
        check(out, ref, "float16", a, b_kn)
        if i % 2:   # the index from a mask that also allows some zero tiles
            wide = mask | T.granular_mask(rng, (M, K), "micro", (1, tk), 0.01)
            m = torch.from_numpy(wide).cuda()
            Lm = launcher(a, b, out, tk, "float16", form, mask=m)
            T.poison(out)
            GemmCall(Lm, a, b, out, m.data_ptr(), reuse=True).run()
            check(out, ref, "float16", a, b_kn)


def test_products_write_a_transposed_output_and_refuse_a_foreign_index():
    """C' with m contiguous (out a transposed view: element stores); an index built elsewhere has
    no row table, so use_index refuses it."""
    rng = np.random.default_rng(33)
    M, N, K, tk = 333, 101, 512, 64
    _, a, b, ref = operands(rng, M, N, K, tk, "micro", "float16", 0.02)
    out_t = T.poison(torch.empty((N, M), dtype=torch.float16, device="cuda"))
    out = out_t.t()
    L = launcher(a, b, out, tk, "float16")
    assert not L.spec.gemm.c_pair and not L.spec.gemm.c_vec
    GemmCall(L, a, b, out).run()
    check(out, ref, "float16", a, b)
    call = GemmCall(L, a, b, out)
    with pytest.raises(PlanError, match="products kernel"):
        call.use_index(torch.zeros(8, dtype=torch.int32, device="cuda"),
                       torch.zeros(8, dtype=torch.int32, device="cuda"))


def test_auto_runs_the_products_kernel_on_rows_of_one_product():
    """`auto` on 1 x 64 micro-tiles at 99% (0.3 per row) plans micro-tiles along m (1 x 64 or
    1 x 128: the profile prices them alike) and runs the products kernel, steady calls on new
    masks of the same sparsity included."""
    rng = np.random.default_rng(34)
    M, N, K = 4096, 1024, 2048   # at 2048 x 512 x 2048 dense cuBLAS is the faster plan
    kern = pitgen.compile(EXPR["B"], sparse="A", dtype="float16")
    b = torch.randn(K, N, device="cuda", dtype=torch.float16)
    for _ in range(3):
        mask = T.granular_mask(rng, (M, K), "micro", (1, 64), 0.01)
        a = torch.from_numpy((rng.standard_normal((M, K)) * mask).astype(np.float32)
                             ).to("cuda", torch.float16)
        out = kern(a, b)
        check(out, a.double().cpu().numpy() @ b.double().cpu().numpy(), "float16", a, b)
    assert (kern.plan.choice.kind, kern.plan.choice.axis) == ("micro", "m"), kern.plan.table()
    (launcher,) = kern._launchers.values()
    assert launcher.spec.gemm.a_mode == "products"
