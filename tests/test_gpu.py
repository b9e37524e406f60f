"""GPU tests of the JIT kernels against float64 NumPy references (marker ``gpu``; skipped with
the reason where no CUDA device, torch or pycuda is present)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pitgen
from pitgen import testing as T
from pitgen.index import build_index

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="GPU tests need torch")

DTYPES = ("bfloat16", "float16", "float32")
FORMS = {  # expression, sparse operand
    "A": ("C[m,n] += A[m,k] * B[k,n]", "A"),
    "At": ("C[m,n] += A[k,m] * B[k,n]", "A"),
    "Bt": ("C[m,n] += A[m,k] * B[n,k]", "A"),
    "sparseB": ("C[m,n] += A[m,k] * B[k,n]", "B"),
    "sparseBt": ("C[m,n] += A[m,k] * B[n,k]", "B"),
}


def _tdt(dtype: str):
    return getattr(torch, dtype)


def operands(rng, form: str, M: int, N: int, K: int, dtype: str, mask_of_s):
    """Device tensors laid out as the form says, S multiplied by its mask; float64 copies."""
    expr, sparse = FORMS[form]
    op = pitgen.parse(expr)
    shapes = {"A": (M, K) if op.access("A").axes[0] == "m" else (K, M),
              "B": (K, N) if op.access("B").axes[0] == "k" else (N, K)}
    arrays = {}
    for name, shp in shapes.items():
        x = rng.standard_normal(shp).astype(np.float32)
        if name == sparse:
            x = x * mask_of_s(shp)
        t = torch.from_numpy(x).to("cuda", _tdt(dtype))
        arrays[name] = t
    ref = pitgen.evaluate(op, {n: t.double().cpu().numpy() for n, t in arrays.items()})
    return op, sparse, arrays, ref


def check(out, ref: np.ndarray, dtype: str, scale: np.ndarray, roundings: int = 0) -> None:
    """float32 GEMMs run on tf32 tensor cores. Every element is held to its own bound, scaled
    by the root-sum-square of its terms (``scale``: gemm_scale): one dropped term fails."""
    T.assert_close(out, ref, "tf32" if dtype == "float32" else dtype, scale=scale,
                   roundings=roundings)


def gemm_scale(op, arrays: dict, base=None) -> np.ndarray:
    """T.term_scale of ``op`` over the operands A and B; with ``base`` (float64: the output
    added to), its elements count as one more term each."""
    scale = T.term_scale(lambda a, b: pitgen.evaluate(op, {"A": a, "B": b}), arrays["A"],
                         arrays["B"])
    if base is None:
        return scale
    return np.sqrt(scale ** 2 + base ** 2)


def _shape_for(kind: str, form: str, t_m: int, t_k: int) -> tuple[int, int] | str:
    """A micro-tile/block shape in S's dim order for the kernel kind, or 'dense'."""
    expr, sparse = FORMS[form]
    acc = pitgen.parse(expr).access(sparse)
    k_first = acc.axes[0] == "k"
    if kind == "dense":
        return "dense"
    mk = {"micro_k": (t_m, 1), "micro_m": (1, t_k), "block": (t_m, t_k)}[kind]
    return (mk[1], mk[0]) if k_first else mk


def gpu_sets(counts, ids, ref: dict) -> dict:
    """The GPU index's lists as the reference's sets (``ref``: its sets by group), each id
    checked to lie in its list's range. Micro-tiles along m list a k-tile's rows per row block
    of the kernel (list kt * blocks + rb: rows of block rb, ``ids.shape[1]`` rows a block):
    merged per k-tile here; other plans have one list per group (blocks = 1)."""
    counts, ids = counts.cpu().numpy(), ids.cpu().numpy()
    blocks, cap = len(counts) // len(ref), ids.shape[1]
    assert len(counts) == blocks * len(ref)
    out = {}
    for g in range(len(ref)):
        rows = []
        for rb in range(blocks):
            listed = ids[g * blocks + rb, :counts[g * blocks + rb]]
            assert all(rb * cap <= r < (rb + 1) * cap for r in listed)
            rows += [int(r) for r in listed]
        assert len(set(rows)) == len(rows)  # no row twice
        out[(g,)] = frozenset(rows)
    return out


sizes = T.extents(200)
KINDS = ("dense", "micro_k", "micro_m", "block")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=T.examples(8, share=len(KINDS) * len(FORMS) * len(DTYPES)), deadline=None,
          suppress_health_check=list(HealthCheck))
@given(M=sizes, N=sizes, K=sizes, t_m=st.sampled_from([16, 32, 64, 128]),
       t_k=st.sampled_from([16, 32, 64, 128]), gran=st.sampled_from(T.MASK_KINDS),
       density=st.sampled_from([0.05, 0.3, 0.7]), seed=st.integers(0, 2**31 - 1))
def test_kernel_matches_float64_reference(dtype, form, kind, M, N, K, t_m, t_k, gran, density, seed):
    rng = np.random.default_rng(seed)
    micro = _shape_for(kind, form, t_m, t_k)
    tile = micro if micro != "dense" else (32, 1)
    op, sparse, arrays, ref = operands(
        rng, form, M, N, K, dtype, lambda shp: T.granular_mask(rng, shp, gran, tile, density))
    kern = pitgen.compile(op, sparse=sparse, dtype=dtype, micro_tile=micro, vendor_dense=False)
    out = T.poison(torch.empty(ref.shape, dtype=_tdt(dtype), device="cuda"))
    res = kern(**arrays, out=out)
    assert res is out
    check(out, ref, dtype, gemm_scale(op, arrays))


@pytest.mark.parametrize("form", sorted(FORMS))   # spread over workers in the thorough profile
@settings(max_examples=T.examples(5, share=len(FORMS)), deadline=None,
          suppress_health_check=list(HealthCheck))
@given(kind=st.sampled_from(["micro_k", "micro_m", "block"]), M=sizes, N=st.integers(1, 40),
       K=sizes, t=st.sampled_from([16, 32, 64]), gran=st.sampled_from(T.MASK_KINDS),
       seed=st.integers(0, 2**31 - 1))
def test_gpu_index_equals_reference_as_sets(form, kind, M, N, K, t, gran, seed):
    rng = np.random.default_rng(seed)
    micro = _shape_for(kind, form, t, t)
    op, sparse, arrays, _ = operands(
        rng, form, M, N, K, "float16", lambda shp: T.granular_mask(rng, shp, gran, micro, 0.2))
    kern = pitgen.compile(op, sparse=sparse, dtype="float16", micro_tile=micro)
    counts, ids = kern.index(**arrays)
    ref = build_index(arrays[sparse].float().cpu().numpy() != 0, op, sparse, kern.plan).sets()
    assert gpu_sets(counts, ids, ref) == ref


@pytest.mark.parametrize("kind", ["dense", "micro_k", "micro_m", "block"])
def test_accumulate_adds_to_out(kind):
    rng = np.random.default_rng(1)
    micro = _shape_for(kind, "A", 32, 64)
    op, sparse, arrays, ref = operands(rng, "A", 150, 70, 300, "float32",
                                       lambda s: T.granular_mask(rng, s, "element", (1, 1), 0.3))
    kern = pitgen.compile(op, sparse=sparse, dtype="float32", micro_tile=micro, vendor_dense=False)
    base = torch.randn(150, 70, device="cuda")
    out = base.clone()
    kern(**arrays, out=out, accumulate=True)
    base64 = base.double().cpu().numpy()
    check(out, ref + base64, "float32", gemm_scale(op, arrays, base64))


def test_rows_outside_the_index_are_zero_and_multi_k_tiles_accumulate():
    rng = np.random.default_rng(2)
    op, sparse, arrays, ref = operands(rng, "A", 257, 130, 333, "float16",
                                       lambda s: T.granular_mask(rng, s, "row", (1, 1), 0.1))
    for micro in ((1, 64), (1, 512)):  # several k-tiles / one covering K
        out = T.poison(torch.empty((257, 130), dtype=torch.float16, device="cuda"))
        pitgen.compile(op, sparse=sparse, dtype="float16", micro_tile=micro)(**arrays, out=out)
        check(out, ref, "float16", gemm_scale(op, arrays))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_every_m_to_65_one_kernel_across_masks(dtype):
    """Micro-tiles along m (the row-owner kernel): every M from 1 to 65 (one row block, and the
    first M past it), K below one k-tile and K not a multiple of 16, odd N; one compiled kernel
    per micro-tile reused across micro-tile, empty and full masks; outputs poisoned with NaN
    (every element must be written). Accumulating, rows that no k-tile lists keep their bits."""
    rng = np.random.default_rng(8)
    N = 45
    for K, tk in ((13, 64), (77, 32)):
        kern = pitgen.compile("C[m,n] += A[m,k] * B[k,n]", sparse="A", dtype=dtype,
                              micro_tile=(1, tk))
        b = torch.from_numpy(rng.standard_normal((K, N)).astype(np.float32)).to("cuda", _tdt(dtype))
        for M in range(1, 66):
            for kind in ("micro", "empty", "full"):
                mask = T.granular_mask(rng, (M, K), kind, (1, tk), 0.3)
                a = torch.from_numpy((rng.standard_normal((M, K)) * mask).astype(np.float32)
                                     ).to("cuda", _tdt(dtype))
                ref = a.double().cpu().numpy() @ b.double().cpu().numpy()
                scale = T.term_scale(np.matmul, a, b)
                out = T.poison(torch.empty((M, N), dtype=_tdt(dtype), device="cuda"))
                assert kern(a, b, out=out) is out
                check(out, ref, dtype, scale)
                base = torch.randn(M, N, device="cuda").to(_tdt(dtype))
                acc = base.clone()
                kern(a, b, out=acc, accumulate=True)
                base64 = base.double().cpu().numpy()
                check(acc, ref + base64, dtype, np.sqrt(scale ** 2 + base64 ** 2))
                idle = torch.from_numpy(~mask.any(axis=1)).cuda()
                assert torch.equal(acc[idle], base[idle]), (K, M, kind)


@pytest.mark.parametrize("micro", ["32x1", "64x64", "128x128", "1x64"])
def test_calls_reusing_the_index_alternate_counts_with_no_memset(micro):
    """Back-to-back calls of one kernel reuse the launcher's index buffers: each index launch
    zeroes the other half of its counts pair for the next one (no memset). Masks that change
    from call to call (dense, empty, sparse, in a cycle longer than the pair) must each give
    their own product, and the counts a call reports must be its own."""
    rng = np.random.default_rng(21)
    M, N, K = 256, 136, 320
    tile = tuple(int(v) for v in micro.split("x"))
    kern = pitgen.compile("C[m,n] += A[m,k] * B[k,n]", sparse="A", dtype="float16",
                          micro_tile=micro)
    b = torch.randn(K, N, device="cuda", dtype=torch.float16)
    for i, kind in enumerate(("full", "micro", "empty", "micro", "full", "empty", "micro")):
        mask = T.granular_mask(rng, (M, K), kind, tile, 0.2)
        a = torch.from_numpy((rng.standard_normal((M, K)) * mask).astype(np.float32)
                             ).to("cuda", torch.float16)
        out = T.poison(torch.empty((M, N), dtype=torch.float16, device="cuda"))
        assert kern(a, b, out=out) is out
        check(out, a.double().cpu().numpy() @ b.double().cpu().numpy(), "float16",
              T.term_scale(np.matmul, a, b))
        call = kern._prepare((a, b), {}, out, False, None, reuse=True)
        call.build_index(None)
        expect = kern.index(a, b)[0]
        assert torch.equal(call.counts.cpu(), expect.cpu()), (micro, i, kind)


@pytest.mark.parametrize("form", ["A", "At", "sparseB", "sparseBt"])
def test_rows_span_several_windows_and_row_blocks(form):
    """More k-tiles than a CTA lists at once (313 of 16 > 256), M' over several row blocks, the
    index built by rows (k contiguous) and by threads (m contiguous), C' either way round."""
    rng = np.random.default_rng(10)
    micro = _shape_for("micro_m", form, 1, 16)
    op, sparse, arrays, ref = operands(
        rng, form, 300, 600, 5000, "float16",
        lambda shp: T.granular_mask(rng, shp, "micro", micro, 0.1))
    kern = pitgen.compile(op, sparse=sparse, dtype="float16", micro_tile=micro)
    out = T.poison(torch.empty(ref.shape, dtype=torch.float16, device="cuda"))
    kern(**arrays, out=out)
    check(out, ref, "float16", gemm_scale(op, arrays))
    counts, ids = kern.index(**arrays)
    sets = build_index(arrays[sparse].float().cpu().numpy() != 0, op, sparse, kern.plan).sets()
    assert gpu_sets(counts, ids, sets) == sets


def test_rows_index_built_once_serves_kernels_of_the_same_rows():
    """PIT's MoE scheme (pitgen.bench's shared routing index): one rows index over a token x
    (expert, 16) indicator lists every expert's tokens per row block; each expert's GEMM (1 x H
    micro-tiles over the same tokens: the same row blocks) runs over its slice of that index."""
    rng = np.random.default_rng(11)
    tokens, experts, H, F = 300, 5, 40, 24
    eid = rng.integers(0, experts, tokens)
    onehot = eid[:, None] == np.arange(experts)[None, :]
    ind = torch.from_numpy(np.repeat(onehot, 16, axis=1).astype(np.float16)).cuda()
    x = torch.randn(tokens, H, device="cuda", dtype=torch.float16)
    w = torch.randn(experts, H, F, device="cuda", dtype=torch.float16)
    kr = pitgen.compile("R[t,n] += I[t,k] * D[k,n]", sparse="I", dtype="float16",
                        micro_tile=(1, 16))
    route = kr.prepare(ind, torch.zeros(experts * 16, 16, device="cuda", dtype=torch.float16))
    route.build_index(None)
    counts, ids = route.counts, route.ids
    n = counts.numel() // experts
    k1 = pitgen.compile("Y[t,f] += X[t,h] * W[h,f]", sparse="X", dtype="float16", micro_tile=(1, H))
    y = torch.zeros(tokens, F, device="cuda", dtype=torch.float16)
    for e in range(experts):
        call = k1.prepare(x, w[e], out=y, accumulate=True)
        call.use_index(counts[e * n:(e + 1) * n], ids[e * n:(e + 1) * n])
        call.compute(None)
    torch.cuda.synchronize()
    x64, w64 = x.double().cpu().numpy(), w.double().cpu().numpy()
    ref = sum((x64 * onehot[:, e:e + 1]) @ w64[e] for e in range(experts))
    scale = np.sqrt(sum((x64 * onehot[:, e:e + 1]) ** 2 @ w64[e] ** 2 for e in range(experts)))
    check(y, ref, "float16", scale)


def test_auto_picks_the_micro_tile_of_the_pattern_and_dense_when_full():
    """Large enough that the sparse plan's index launch pays (at 1024 x 256 x 1024 dense
    cuBLAS is the faster plan, and `auto` runs it)."""
    rng = np.random.default_rng(3)
    mask = T.granular_mask(rng, (2048, 2048), "micro", (32, 1), 0.05)
    op, sparse, arrays, ref = operands(rng, "A", 2048, 1024, 2048, "float16", lambda s: mask)
    kern = pitgen.compile(op, sparse=sparse, dtype="float16")
    check(kern(**arrays), ref, "float16", gemm_scale(op, arrays))
    assert kern.plan.choice.kind == "micro" and kern.plan.choice.axis == "k"
    assert kern.plan.choice.waste == 0
    kern.replan()
    full = {n: torch.randn_like(t.float()).to(t.dtype) for n, t in arrays.items()}
    kern(**full)
    assert kern.plan.choice.kind == "dense"


def test_counts_on_the_gpu_match_the_mask_planners():
    """The GPU planner's reductions count what the mask planner counts on the host: micro-tiles
    along m per row block of the row-owner kernel (1,100 rows: blocks of 512, 512 and 76),
    along k within the whole axis, blocks; the same candidates, costs and choice."""
    from pitgen.coverage import plan_on_device
    from pitgen.operands import as_operand
    from pitgen.planner import make_plan
    rng = np.random.default_rng(3)
    for shape, tile in (((1100, 320), (1, 64)), ((700, 200), (32, 1)), ((96, 160), (64, 64))):
        mask = T.tile_mask(rng, *shape, tile, 0.2)
        a = torch.from_numpy(np.where(mask, rng.standard_normal(shape), 0.0)).cuda()
        want = make_plan(FORMS["A"][0], "A", mask=mask)
        got = plan_on_device(pitgen.parse(FORMS["A"][0]), "A", as_operand("A", a))
        assert got.candidates == want.candidates and got.choice == want.choice


def test_noncontiguous_views_and_a_side_stream():
    rng = np.random.default_rng(4)
    A = torch.randn(300, 200, device="cuda", dtype=torch.float16)[:, ::2]  # stride (200, 2)
    A = A * (torch.rand_like(A.float()) < 0.2).to(A.dtype)
    B = torch.randn(100, 90, device="cuda", dtype=torch.float16).t().contiguous().t()  # (1, 100)
    ref = A.double().cpu().numpy() @ B.double().cpu().numpy()
    s = torch.cuda.Stream()
    kern = pitgen.compile("C[m,n] += A[m,k] * B[k,n]", sparse="A", dtype="float16", micro_tile="32x1")
    with torch.cuda.stream(s):
        out = kern(A, B)
    torch.cuda.current_stream().wait_stream(s)
    check(out, ref, "float16", T.term_scale(np.matmul, A, B))
    del rng


@pytest.mark.parametrize("accumulate", [False, True])
def test_dense_plan_runs_cublas_through_torch(accumulate):
    rng = np.random.default_rng(6)
    op, sparse, arrays, ref = operands(rng, "sparseBt", 70, 90, 50, "float16",
                                       lambda s: T.granular_mask(rng, s, "full", (1, 1), 1.0))
    kern = pitgen.compile(op, sparse=sparse, dtype="float16", micro_tile="dense")
    out = torch.randn(70, 90, device="cuda").half().t().contiguous().t()  # column-major out
    base = out.double().cpu().numpy()
    kern(**arrays, out=out, accumulate=accumulate)
    assert kern.index(**arrays) == (None, None)
    # cuBLAS may reduce split-k partials in float16 (torch's
    # allow_fp16_reduced_precision_reduction, on by default): one rounding of partial sums
    check(out, ref + base if accumulate else ref, "float16",
          gemm_scale(op, arrays, base if accumulate else None), roundings=1)


@pytest.mark.parametrize("micro", ["32x1", "1x64", "1x512", "32x64"])
def test_index_from_a_byte_mask(micro):
    rng = np.random.default_rng(7)
    shape = tuple(int(v) for v in micro.split("x"))
    mask_np = T.granular_mask(rng, (200, 300), "micro", shape, 0.3)
    op, sparse, arrays, ref = operands(rng, "A", 200, 70, 300, "float16", lambda s: mask_np)
    mask = torch.from_numpy(mask_np).cuda()
    kern = pitgen.compile(op, sparse=sparse, dtype="float16", micro_tile=micro)
    for m in (mask, mask.to(torch.uint8)):
        out = T.poison(torch.empty(ref.shape, dtype=torch.float16, device="cuda"))
        kern(**arrays, out=out, mask=m)
        check(out, ref, "float16", gemm_scale(op, arrays))
        counts, ids = kern.index(**arrays, mask=m)
        sets = build_index(mask_np, op, sparse, kern.plan).sets()
        assert gpu_sets(counts, ids, sets) == sets
    with pytest.raises(pitgen.ShapeError, match="mask has shape"):
        kern(**arrays, mask=mask[:, :-1])
    with pytest.raises(pitgen.ShapeError, match="mask has dtype"):
        kern(**arrays, mask=mask.float())


def test_pycuda_gpuarrays():
    import pycuda.autoprimaryctx  # noqa: F401  (a GPUArray user makes PyCUDA's context current)
    import pycuda.gpuarray as ga

    rng = np.random.default_rng(5)
    a = (rng.standard_normal((100, 80)) * (rng.random((100, 80)) < 0.3)).astype(np.float32)
    b = rng.standard_normal((80, 60)).astype(np.float32)
    kern = pitgen.compile("C[m,n] += A[m,k] * B[k,n]", sparse="A", dtype="float32", micro_tile="16x1")
    out = kern(ga.to_gpu(a), ga.to_gpu(b))
    ref = a.astype(np.float64) @ b
    check(out.get(), ref, "float32", T.term_scale(np.matmul, a, b))


def test_bad_input_is_refused_with_a_pitgen_error():
    kern = pitgen.compile("C[m,n] += A[m,k] * B[k,n]", sparse="A", dtype="float16", micro_tile="32x1")
    a = torch.randn(64, 32, device="cuda", dtype=torch.float16)
    b = torch.randn(32, 16, device="cuda", dtype=torch.float16)
    with pytest.raises(pitgen.DeviceError, match="cpu"):
        kern(a.cpu(), b)
    with pytest.raises(pitgen.ShapeError, match="dtype"):
        kern(a.float(), b)
    with pytest.raises(pitgen.ShapeError, match="extent"):
        kern(a, torch.randn(31, 16, device="cuda", dtype=torch.float16))
    with pytest.raises(pitgen.ShapeError, match="overlapping"):
        kern(a, b, out=torch.empty(1, device="cuda", dtype=torch.float16).expand(64, 16))
    with pytest.raises(pitgen.ShapeError, match="missing"):
        kern(a)
    big = torch.empty(1, device="cuda", dtype=torch.float16).expand(70000, 40000)
    with pytest.raises(pitgen.PlanError, match="overflow"):
        kern(big, torch.empty(1, device="cuda", dtype=torch.float16).expand(40000, 8))
    with pytest.raises(pitgen.PlanError):
        pitgen.compile("C[m,n] += A[m,k] * B[k,n]", sparse="A", micro_tile="1x1x1")
    with pytest.raises(pitgen.PitgenError, match="no GPU kernel"):
        pitgen.compile("O[n,f,y,x] += I[n,c,y+r,x+s] * W[f,c,r,s]", sparse="W")
