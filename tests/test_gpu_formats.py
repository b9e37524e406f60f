"""GPU tests of the sparse formats: every conversion on the GPU equals its NumPy reference
(pitgen.graph.formats) slot for slot; SpMM and SDDMM in every format x dtype x feature size agree with
float64 references; outputs are poisoned first; bad input raises pitgen errors."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pitgen import reference as R
from pitgen import testing as T
from pitgen import DeviceError, PlanError, ShapeError
from pitgen.graph import formats as fm
from pitgen.graph.device import DeviceCOO, DeviceCSR, to_format
from pitgen.graph.kernels import default_schedule, schedule_space, sddmm, spmm, spmm_coo

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="GPU tests need torch")

DTYPES = ("float32", "float16")
LAYOUTS = [("csr", {}), ("ell", {}), ("bsr", {"block": 8}), ("bsr", {"block": 16}),
           ("hyb", {"c": 1, "k": 2}), ("hyb", {"c": 3, "k": 3}), ("hyb", {"c": 1, "k": 0})]
FEATS = (32, 33, 64, 130)
GPU_SETTINGS = settings(max_examples=T.examples(10), deadline=None)


#: every kind of CSR: empty rows, a dense row, long rows (cut by hyb), power-law rows, one
#: column, nnz = 0 and empty shapes
MATRICES = T.csr_matrices(max_rows=70, max_cols=90)


def rounded(csr: fm.CSR, dtype: str) -> fm.CSR:
    """The CSR with its values rounded to dtype: what the device holds, exactly."""
    return fm.CSR(csr.shape, csr.indptr, csr.indices,
                  csr.values().astype(dtype).astype(np.float64))


def dense_operand(rng, shape, dtype):
    x = rng.standard_normal(shape).astype(np.float32)
    t = torch.from_numpy(x).to("cuda", getattr(torch, dtype))
    return t, t.double().cpu().numpy()


def spmm_want(csr: fm.CSR, x64: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """SpMM's float64 reference and the root-sum-square of each output's terms A[i,j] X[j,f]."""
    return R.spmm_csr(csr, x64), T.term_scale(R.spmm_csr, csr, x64)


def sddmm_want(csr: fm.CSR, u64: np.ndarray, v64: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """SDDMM's float64 reference (CSR order) and the root-sum-square of each edge's terms."""
    return R.sddmm_csr(csr, u64, v64), T.term_scale(R.sddmm_csr, csr, u64, v64)


def check(got, want: tuple[np.ndarray, np.ndarray], dtype: str) -> None:
    """Every element within its own bound (fp32 accumulation, the output rounded to dtype):
    one dropped term fails."""
    T.assert_close(got, want[0], dtype, scale=want[1])


def reference_layout(csr: fm.CSR, fmt: str, params: dict):
    if fmt == "csr":
        return csr
    if fmt == "ell":
        return fm.ELL.from_csr(csr)
    if fmt == "bsr":
        return fm.BSR.from_csr(csr, params["block"])
    return fm.Hyb.from_csr(csr, params["c"], params["k"])


def assert_same_layout(got, want, fmt: str) -> None:
    if fmt == "csr":
        np.testing.assert_array_equal(got.indptr, want.indptr)
        np.testing.assert_array_equal(got.indices, want.indices)
        np.testing.assert_array_equal(got.values(), want.values())
    elif fmt == "ell":
        np.testing.assert_array_equal(got.cols, want.cols)
        np.testing.assert_array_equal(got.vals, want.vals)
    elif fmt == "bsr":
        for name in ("indptr", "indices", "blocks", "mask"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    else:
        assert [(b.part, b.width) for b in got.buckets] == [(b.part, b.width) for b in want.buckets]
        for g, w in zip(got.buckets, want.buckets):
            np.testing.assert_array_equal(g.row_ids, w.row_ids)
            np.testing.assert_array_equal(g.cols, w.cols)
            np.testing.assert_array_equal(g.vals, w.vals)
            assert g.needs_atomics == w.needs_atomics


@GPU_SETTINGS
@given(MATRICES, st.sampled_from(DTYPES))
def test_conversions_match_numpy_reference(csr, dtype):
    ref = rounded(csr, dtype)
    d = DeviceCSR.from_host(csr, dtype)
    for fmt, params in LAYOUTS:
        m = to_format(d, fmt, **params)
        if fmt != "csr":   # converted once per pattern while held (csr: a view per call)
            assert to_format(d, fmt, **params) is m
        assert_same_layout(m.to_host(), reference_layout(ref, fmt, params), fmt)
        np.testing.assert_array_equal(m.to_dense().double().cpu().numpy(), ref.to_dense())
        if fmt == "hyb":
            assert_same_hyb_plan(m, ref, params)


def assert_same_hyb_plan(m, ref: fm.CSR, params: dict) -> None:
    """The write plan equals Hyb.write_plan's; every slot's perm, column and row agree with
    the CSR entry it holds, and padding is -1 in all three."""
    for name, want in reference_layout(ref, "hyb", params).write_plan().items():
        np.testing.assert_array_equal(m.buffers[name].cpu().numpy(), want, err_msg=name)
    perm, cols, srow = (m.buffers[n].cpu().numpy() for n in ("perm", "cols", "slot_row"))
    pad = perm < 0
    assert (cols[pad] == -1).all() and (srow[pad] == -1).all()
    np.testing.assert_array_equal(cols[~pad], ref.indices[perm[~pad]])
    np.testing.assert_array_equal(srow[~pad], ref.row_ids()[perm[~pad]])
    assert np.unique(perm[~pad]).size == ref.nnz


@pytest.mark.parametrize("c,k", [(1, 0), (1, 2), (1, 4), (2, 3), (3, 6), (8, 1)])
def test_hyb_of_many_row_blocks_matches_numpy(c, k):
    """Thousands of rows (many CTAs of the conversion passes; at 70,000 rows more than one
    round of pass 1's scan), power-law rows cut into pieces, empty rows: the layout and its
    write plan equal the NumPy reference's."""
    csr = power_law(11 + c + k, 3000 if c + k < 8 else 70_000, 700)
    for dtype in DTYPES:
        ref = rounded(csr, dtype)
        m = to_format(DeviceCSR.from_host(csr, dtype), "hyb", c=c, k=k)
        assert_same_layout(m.to_host(), reference_layout(ref, "hyb", {"c": c, "k": k}), "hyb")
        assert_same_hyb_plan(m, ref, {"c": c, "k": k})


@pytest.mark.parametrize("c,k", [(1, 3), (2, 2)])
def test_hyb_with_more_row_groups_than_its_grid_holds(c, k):
    """pit_hyb_layout's grid is capped at the CTAs the device holds at once, so with more row
    groups than that CTAs claim several groups in turn before they wait for all to be ranked;
    sized by bounds or exactly, the layout and write plan equal the NumPy reference's."""
    from pitgen.graph.device import HYB_THREADS, _convert_kernels

    resident = _convert_kernels("float32").resident("pit_hyb_layout", HYB_THREADS)
    csr = power_law(31 + c + k, 2 * resident * HYB_THREADS + 77, 500)
    assert -(-csr.shape[0] // HYB_THREADS) > resident
    ref = rounded(csr, "float32")
    want = reference_layout(ref, "hyb", {"c": c, "k": k})
    d = DeviceCSR.from_host(csr, "float32")
    for m in (to_format(d, "hyb", c=c, k=k), to_format(d, "hyb", sync=False, c=c, k=k).exact()):
        assert_same_layout(m.to_host(), want, "hyb")
        assert_same_hyb_plan(m, ref, {"c": c, "k": k})


@GPU_SETTINGS
@given(MATRICES, st.sampled_from(DTYPES), st.sampled_from([(1, 0), (1, 2), (2, 1), (3, 3)]),
       st.sampled_from(["pieces", "atomic"]), st.integers(0, 2**32 - 1))
def test_hyb_sized_by_bounds_computes_the_same(csr, dtype, ck, cut, seed):
    """sync=False: buffers sized by bounds, no host sync; SpMM (either cut schedule) and
    SDDMM agree with the references, new values refill it, and exact() reads the same layout
    and write plan as the exactly sized conversion."""
    c, k = ck
    rng = np.random.default_rng(seed)
    d = DeviceCSR.from_host(csr, dtype)
    m = to_format(d, "hyb", sync=False, c=c, k=k)
    assert not m.info["exact"] and m.info["slots"] == 2 * csr.nnz
    x, x64 = dense_operand(rng, (csr.shape[1], 40), dtype)
    u, u64 = dense_operand(rng, (csr.shape[0], 40), dtype)
    ref = rounded(csr, dtype)
    y = torch.full((csr.shape[0], 40), float("nan"), device="cuda", dtype=getattr(torch, dtype))
    check(spmm(m, x, schedule={"cut": cut}, out=y), spmm_want(ref, x64), dtype)
    check(sddmm(m, u, x), sddmm_want(csr, u64, x64), dtype)
    vals = torch.from_numpy(rng.standard_normal(csr.nnz)).to("cuda", getattr(torch, dtype))
    new = fm.CSR(csr.shape, csr.indptr, csr.indices, vals.double().cpu().numpy())
    check(spmm(m.with_values(vals), x), spmm_want(new, x64), dtype)
    e = m.exact()
    assert e.info == to_format(d, "hyb", c=c, k=k).info
    assert_same_layout(e.to_host(), reference_layout(ref, "hyb", {"c": c, "k": k}), "hyb")
    assert_same_hyb_plan(e, ref, {"c": c, "k": k})


def test_dynamic_kernel_never_waits_after_its_first_graph():
    """pitgen.compile(..., dynamic=True): new edge lists every call, each result right; after
    the first call of a shape nothing synchronises (torch's sync debug mode would raise)."""
    import pitgen
    base = power_law(5, 600, 500)
    rng = np.random.default_rng(5)
    x, x64 = dense_operand(rng, (500, 64), "float32")
    rows_all, cols_all = base.row_ids(), base.indices
    for i in range(8):
        if i % 4 == 0:
            k = pitgen.compile("Y[i,f] += A[i,j] * X[j,f]", sparse="A",
                               format="auto" if i == 0 else "hyb", dtype="float32",
                               dynamic=True)
        keep = rng.random(base.nnz) < 0.8
        rows = torch.from_numpy(rows_all[keep]).cuda()
        cols = torch.from_numpy(cols_all[keep]).cuda()
        vals = torch.from_numpy(rng.standard_normal(int(keep.sum())).astype(np.float32)).cuda()
        want = fm.CSR((600, 500), np.concatenate([[0], np.cumsum(np.bincount(
            rows_all[keep], minlength=600))]).astype(np.int32), cols_all[keep],
            vals.double().cpu().numpy())
        torch.cuda.set_sync_debug_mode("error" if i % 4 else "default")
        try:
            got = k(DeviceCSR.from_coo((600, 500), rows, cols, vals, check=False,
                                       sort=i % 2 == 0), x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        check(got, spmm_want(want, x64), "float32")
    assert next(iter(k._by_shape.values()))[0] == "hyb"
    with pytest.raises(PlanError, match="dynamic"):
        pitgen.compile("Y[i,f] += A[i,j] * X[j,f]", sparse="A", format="ell", dynamic=True)


@GPU_SETTINGS
@given(MATRICES, st.sampled_from(DTYPES), st.integers(0, 2**32 - 1))
def test_from_coo_sorts_edges_on_gpu(csr, dtype, seed):
    """Edges in any order (int32 or int64) give from_host's CSR; a duplicate edge adds."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(csr.nnz)
    idx = torch.int32 if seed % 2 else torch.int64
    rows = torch.from_numpy(csr.row_ids()[order]).to("cuda", idx)
    cols = torch.from_numpy(csr.indices[order]).to("cuda", idx)
    # rounded on the host as from_host rounds (torch's float64 -> float16 on the device goes
    # through float32: a value near a half-way point can land one ulp apart)
    vals = torch.from_numpy(csr.values()[order].astype(dtype)).cuda()
    d = DeviceCSR.from_coo(csr.shape, rows, cols, vals)
    want = DeviceCSR.from_host(csr, dtype)
    for name in ("indptr", "indices", "values"):
        assert torch.equal(getattr(d, name), getattr(want, name)), name
    ones = DeviceCSR.from_coo(csr.shape, rows, cols, check=False)
    assert ones.dtype == "float32" and bool((ones.values == 1).all())
    # sort=False: the same rows, each row's (column, value) pairs in any order
    any_order = DeviceCSR.from_coo(csr.shape, rows, cols, vals, sort=False)
    assert not any_order.sorted_columns and torch.equal(any_order.indptr, want.indptr)
    got_cols, got_vals = any_order.indices.cpu().numpy(), any_order.values.cpu().numpy()
    for r in range(csr.shape[0]):
        lo, hi = csr.indptr[r], csr.indptr[r + 1]
        by_col = np.argsort(got_cols[lo:hi], kind="stable")
        np.testing.assert_array_equal(got_cols[lo:hi][by_col], csr.indices[lo:hi])
        np.testing.assert_array_equal(got_vals[lo:hi][by_col],
                                      want.values[lo:hi].cpu().numpy())
    assert torch.equal(to_format(any_order, "hyb", c=1, k=2).to_dense(),
                       to_format(want, "hyb", c=1, k=2).to_dense())
    with pytest.raises(PlanError, match="column parts"):
        to_format(any_order, "hyb", c=2, k=2)
    if csr.nnz:
        dup = DeviceCSR.from_coo(csr.shape, torch.cat([rows, rows[:1]]),
                                 torch.cat([cols, cols[:1]]), torch.cat([vals, vals[:1]]))
        dense = want.to_torch().to_dense().double()
        dense[int(rows[0]), int(cols[0])] *= 2
        got = to_format(dup, "hyb", c=2, k=2).to_dense().double()
        assert torch.equal(got, dense)


def test_dropped_layouts_free_their_memory_without_the_garbage_collector():
    """A layout holds its DeviceCSR and the DeviceCSR's cache holds layouts only weakly: no
    reference cycle, so a graph that changes every call does not pile up GPU memory."""
    import gc
    d = DeviceCSR.from_host(power_law(3, 500, 400))
    x = torch.randn(400, 32, device="cuda")
    spmm(to_format(d, "hyb", c=1, k=2), x)   # warm: modules, counters
    torch.cuda.synchronize()
    gc.collect()
    gc.disable()
    try:
        base = torch.cuda.memory_allocated()
        for sync in (True, False, True):
            fresh = DeviceCSR(d.shape, d.indptr, d.indices, d.values)
            m = to_format(fresh, "hyb", sync=sync, c=2, k=3)
            assert to_format(fresh, "hyb", sync=sync, c=2, k=3) is m
            spmm(m, x)
            del fresh, m
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == base
    finally:
        gc.enable()


@GPU_SETTINGS
@given(st.integers(1, 300), st.integers(1, 60), st.integers(0, 400), st.integers(0, 2**32 - 1))
def test_corrupt_csr_buffers_stay_in_bounds(rows, cols, nnz, seed):
    """No conversion or kernel trusts an index: a DeviceCSR whose indptr is not monotone and
    whose columns are out of range or unordered converts (each layout, hyb with and without
    its sync) and multiplies without touching memory outside its buffers (a fault would
    surface at the synchronize; tools/sanitize runs the same under memcheck)."""
    rng = np.random.default_rng(seed)
    indptr = torch.from_numpy(rng.integers(-3, nnz + 4, rows + 1).astype(np.int32)).cuda()
    indices = torch.from_numpy(rng.integers(-2, cols + 3, nnz).astype(np.int32)).cuda()
    d = DeviceCSR((rows, cols), indptr, indices, torch.randn(nnz, device="cuda"))
    x = torch.randn(cols, 16, device="cuda")
    u = torch.randn(rows, 16, device="cuda")
    for fmt, params in [("csr", {}), ("ell", {}), ("bsr", {"block": 8}),
                        ("hyb", {"c": 1, "k": 2}), ("hyb", {"c": 3, "k": 1}),
                        ("hyb", {"c": 1, "k": 3, "sync": False}),
                        ("hyb", {"c": 2, "k": 0, "sync": False})]:
        m = to_format(d, fmt, **params)
        spmm(m, x)
        sddmm(m, u, x)
    r = torch.from_numpy(rng.integers(-2, rows + 2, nnz)).cuda()
    c = torch.from_numpy(rng.integers(-2, cols + 2, nnz)).cuda()
    for sort in (True, False):
        spmm(to_format(DeviceCSR.from_coo((rows, cols), r, c, check=False, sort=sort), "hyb",
                       c=1, k=2, sync=False), x)
    torch.cuda.synchronize()


def test_from_coo_refuses_or_drops_edges_out_of_range():
    rows = torch.tensor([0, 1, 5], device="cuda")
    cols = torch.tensor([1, 0, 0], device="cuda")
    for sort in (True, False):
        with pytest.raises(ShapeError, match="edge 2 = \\(5, 0\\)"):
            DeviceCSR.from_coo((3, 2), rows, cols, sort=sort)
        d = DeviceCSR.from_coo((3, 2), rows, cols, check=False, sort=sort)
        assert d.indptr.tolist() == [0, 1, 2, 2] and d.indices[2].item() == -1
        assert to_format(d, "hyb", c=1, k=1).to_dense().tolist() == [[0, 1], [1, 0], [0, 0]]
    with pytest.raises(ShapeError, match="cols"):
        DeviceCSR.from_coo((3, 2), rows, cols[:2])
    with pytest.raises(ShapeError, match="dtype"):
        DeviceCSR.from_coo((3, 2), rows.float(), cols)
    with pytest.raises(DeviceError):
        DeviceCSR.from_coo((3, 2), rows, cols.cpu())


@GPU_SETTINGS
@given(st.integers(0, 40), st.integers(0, 100), st.sampled_from([0.0, 0.05, 0.5, 1.0]),
       st.sampled_from(["bool", "uint8", "float32", "float16"]), st.integers(0, 2**32 - 1))
def test_from_dense_on_gpu(rows, cols, density, src, seed):
    rng = np.random.default_rng(seed)
    mask = rng.random((rows, cols)) < density
    vals = rng.standard_normal((rows, cols)).astype(np.float32) * mask
    vals[mask & (vals == 0)] = 1.0
    host = mask if src == "bool" else mask.astype(np.uint8) if src == "uint8" else vals.astype(src)
    d = DeviceCSR.from_dense(torch.from_numpy(host).cuda())
    want = fm.CSR.from_dense(host.astype(np.float64) if src != "bool" else host)
    np.testing.assert_array_equal(d.indptr.cpu().numpy(), want.indptr)
    np.testing.assert_array_equal(d.indices.cpu().numpy(), want.indices)
    np.testing.assert_array_equal(d.values.double().cpu().numpy(), want.values())
    assert d.dtype == ("float16" if src == "float16" else "float32")


@GPU_SETTINGS
@given(MATRICES, st.sampled_from(DTYPES), st.sampled_from(FEATS), st.integers(0, 2**32 - 1))
def test_spmm_every_format(csr, dtype, feat, seed):
    rng = np.random.default_rng(seed)
    ref_csr = rounded(csr, dtype)
    x, x64 = dense_operand(rng, (csr.shape[1], feat), dtype)
    want = spmm_want(ref_csr, x64)
    d = DeviceCSR.from_host(csr, dtype)
    for fmt, params in LAYOUTS:
        out = T.poison(torch.empty((csr.shape[0], feat), dtype=x.dtype, device="cuda"))
        got = spmm(to_format(d, fmt, **params), x, out=out)
        assert got is out
        check(got, want, dtype)
    check(spmm(d, x), want, dtype)  # a DeviceCSR runs as "csr"
    # gather unrolls and packs (features per lane per pass) other than the defaults
    for unroll, packs, cut in ((1, 1, "atomic"), (8, 2, "pieces")):
        sched = {"unroll": unroll, "packs": packs}
        hyb = to_format(d, "hyb", c=1, k=2)
        check(spmm(hyb, x, schedule={**sched, "cut": cut}), want, dtype)
        check(spmm(d, x, schedule={**sched, "group": 4}), want, dtype)


@GPU_SETTINGS
@given(MATRICES, st.sampled_from(DTYPES), st.sampled_from((1, 3, 4, 6, 64, 130)),
       st.integers(0, 2**32 - 1))
def test_spmm_of_an_edge_list(csr, dtype, feat, seed):
    """An edge list multiplied as it comes (spmm_coo): edges shuffled and duplicated, int32 or
    int64, values or none (ones), edges outside the matrix skipped, x aligned or not (the
    vector width falls back), out poisoned or allocated; the float64 reference of the CSR."""
    rng = np.random.default_rng(seed)
    ref_csr = rounded(csr, dtype)
    order = rng.permutation(csr.nnz)
    dup = order[: rng.integers(0, csr.nnz + 1)]   # these edges twice: they add up
    edges = np.concatenate([order, dup])
    vals64 = np.concatenate([ref_csr.values()[order], ref_csr.values()[dup]])
    ones = seed % 3 == 0
    times = np.ones(csr.nnz)
    times[dup] += 1   # the reference: each edge once, its value doubled where it is twice
    want_csr = fm.CSR(csr.shape, csr.indptr, csr.indices,
                      times * (1.0 if ones else ref_csr.values()))
    idx = torch.int32 if seed % 2 else torch.int64
    bad = rng.integers(1, 4)   # edges past the matrix (or negative): skipped
    rows = np.concatenate([csr.row_ids()[edges], [csr.shape[0], -1, 0][:bad]])
    cols = np.concatenate([csr.indices[edges], [0, 0, csr.shape[1] + 5][:bad]])
    vals = torch.from_numpy(np.concatenate([vals64, np.ones(bad)])).to("cuda", getattr(torch, dtype))
    a = DeviceCOO(csr.shape, torch.from_numpy(rows).to("cuda", idx),
                  torch.from_numpy(cols).to("cuda", idx), None if ones else vals, dtype=dtype)
    x, x64 = dense_operand(rng, (csr.shape[1], feat), dtype)
    if seed % 5 == 0:   # x one element past an aligned address
        flat = torch.empty(x.numel() + 1, dtype=x.dtype, device="cuda")
        flat[1:] = x.flatten()
        x = flat[1:].view(x.shape)
    want = spmm_want(want_csr, x64)
    out = T.poison(torch.empty((csr.shape[0], feat), dtype=x.dtype, device="cuda"))
    assert spmm_coo(a, x, out=out) is out
    check(out, want, dtype)
    check(spmm_coo(a, x), want, dtype)


def test_format_kernels_take_edge_lists():
    """pitgen.compile(format=...) with a DeviceCOO: 'coo' multiplies it as it comes, 'auto'
    too while the model says it pays (else through a CSR, as 'hyb' always), dynamic or not,
    with no sync in a dynamic kernel after its first graph; misuse raises pitgen errors."""
    import pitgen
    from pitgen.graph import model
    base = power_law(7, 400, 300)
    rng = np.random.default_rng(7)
    x, x64 = dense_operand(rng, (300, 32), "float32")
    rows = torch.from_numpy(base.row_ids()).cuda()
    cols = torch.from_numpy(base.indices).cuda()
    vals = torch.from_numpy(base.values().astype(np.float32)).cuda()
    a = DeviceCOO((400, 300), rows, cols, vals)
    want = spmm_want(rounded(base, "float32"), x64)
    spmm_expr = "Y[i,f] += A[i,j] * X[j,f]"
    for fmt, dynamic in (("coo", False), ("coo", True), ("auto", True), ("hyb", False),
                         ("hyb", True), ("auto", False)):
        k = pitgen.compile(spmm_expr, sparse="A", format=fmt, dtype="float32", dynamic=dynamic)
        check(k(a, x), want, "float32")
        torch.cuda.set_sync_debug_mode("error" if dynamic else "default")
        try:
            got = k(DeviceCOO((400, 300), rows, cols, vals), x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        check(got, want, "float32")
    assert model.coo_pays(base.nnz, 32) and not model.coo_pays(10**9, 64)
    saved = model.CONVERT_HOST_US   # auto through a CSR when the edge list costs more
    model.CONVERT_HOST_US = 0.0
    try:
        k = pitgen.compile(spmm_expr, sparse="A", format="auto", dtype="float32", dynamic=True)
        check(k(a, x), want, "float32")
        assert k._by_shape   # a format was chosen: the edge list went through a CSR
    finally:
        model.CONVERT_HOST_US = saved
    k = pitgen.compile(spmm_expr, sparse="A", format="coo", dtype="float32")
    with pytest.raises(ShapeError, match="DeviceCOO"):
        k(DeviceCSR.from_host(base), x)
    with pytest.raises(ShapeError, match="float16"):
        pitgen.compile(spmm_expr, sparse="A", format="coo", dtype="float32")(
            DeviceCOO((400, 300), rows, cols, vals.half()), x)
    with pytest.raises(ShapeError, match="CSR order"):
        pitgen.compile("E[i,j] += U[i,f] * V[j,f]", sparse="E", format="csr",
                       dtype="float32")(x, x, sample=a)
    with pytest.raises(ShapeError, match="x has dtype"):
        spmm_coo(a, x.half())
    with pytest.raises(ShapeError, match="shape"):
        spmm_coo(a, x[:10])
    with pytest.raises(ShapeError, match="DeviceCOO"):
        spmm_coo(DeviceCSR.from_host(base), x)
    with pytest.raises(ShapeError, match="cols"):
        DeviceCOO((400, 300), rows, cols[:5])
    with pytest.raises(DeviceError):
        DeviceCOO((400, 300), rows, cols.cpu())


@GPU_SETTINGS
@given(MATRICES, st.sampled_from(DTYPES), st.sampled_from(FEATS), st.integers(0, 2**32 - 1))
def test_sddmm_every_format_in_csr_order(csr, dtype, feat, seed):
    rng = np.random.default_rng(seed)
    u, u64 = dense_operand(rng, (csr.shape[0], feat), dtype)
    v, v64 = dense_operand(rng, (csr.shape[1], feat), dtype)
    want = sddmm_want(csr, u64, v64)
    d = DeviceCSR.from_host(csr, dtype)
    for fmt, params in LAYOUTS:
        got = sddmm(to_format(d, fmt, **params), u, v)
        assert got.shape == (csr.nnz,) and got.dtype == u.dtype
        check(got, want, dtype)


def power_law(seed: int, rows: int, cols: int) -> fm.CSR:
    """Row lengths from a power law (some rows far longer than 2^k), random columns."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum((rng.pareto(1.2, rows) * 3).astype(int), cols)
    lengths[rng.integers(rows)] = cols  # one dense row
    lengths[:5] = 0  # empty rows
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    indices = np.concatenate([np.sort(rng.choice(cols, n, replace=False)) for n in lengths])
    return fm.CSR((rows, cols), indptr, indices.astype(np.int32),
                  rng.standard_normal(indices.size))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("feat", [32, 512])
def test_power_law_graph_all_formats(dtype, feat):
    csr = power_law(1, 1500, 1200)
    rng = np.random.default_rng(2)
    x, x64 = dense_operand(rng, (csr.shape[1], feat), dtype)
    u, u64 = dense_operand(rng, (csr.shape[0], feat), dtype)
    want_y = spmm_want(rounded(csr, dtype), x64)
    want_e = sddmm_want(csr, u64, x64)
    d = DeviceCSR.from_host(csr, dtype)
    for fmt, params in [("csr", {}), ("ell", {}), ("bsr", {"block": 32}),
                        ("hyb", {"c": 1, "k": 4}), ("hyb", {"c": 8, "k": 6})]:
        m = to_format(d, fmt, **params)
        if fmt == "hyb" and params["c"] == 1:
            assert m.info["any_cut"] and m.info["atomic"][-1] and not m.info["atomic"][0]
        check(spmm(m, x), want_y, dtype)
        check(sddmm(m, u, x), want_e, dtype)


def test_cut_rows_sum_their_pieces_on_every_call_and_stream():
    """c == 1 hyb: the last piece of a cut row sums the partial rows and resets the row's
    counter, so repeated launches (and launches on another stream) stay right."""
    csr = power_law(7, 400, 300)
    rng = np.random.default_rng(7)
    for dtype in DTYPES:
        x, x64 = dense_operand(rng, (csr.shape[1], 64), dtype)
        want = spmm_want(rounded(csr, dtype), x64)
        m = to_format(DeviceCSR.from_host(csr, dtype), "hyb", c=1, k=2)
        assert m.info["cut_rows"] > 0 and m.info["partial_rows"] > m.info["cut_rows"]
        for _ in range(3):
            check(spmm(m, x), want, dtype)
            check(spmm(m, x, schedule={"cut": "atomic"}), want, dtype)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = spmm(m, x)
        side.synchronize()
        check(y, want, dtype)
        assert len(m.counters) == 2
        assert all(int(c.abs().sum()) == 0 for c in m.counters.values())   # reset by the rows


@pytest.mark.parametrize("fmt,params", LAYOUTS[:3] + LAYOUTS[4:6])
@pytest.mark.parametrize("dtype", DTYPES)
def test_schedules_from_the_space(fmt, params, dtype):
    csr = power_law(3, 300, 250)
    rng = np.random.default_rng(4)
    feat = 96
    x, x64 = dense_operand(rng, (csr.shape[1], feat), dtype)
    u, u64 = dense_operand(rng, (csr.shape[0], feat), dtype)
    want_y, want_e = spmm_want(rounded(csr, dtype), x64), sddmm_want(csr, u64, x64)
    m = to_format(DeviceCSR.from_host(csr, dtype), fmt, **params)
    for op, want in (("spmm", want_y), ("sddmm", want_e)):
        space = schedule_space(op, fmt, feat, dtype)
        assert default_schedule(op, fmt, feat, dtype) in space
        for sched in (space[0], space[len(space) // 2], space[-1]):
            got = spmm(m, x, schedule=sched) if op == "spmm" else sddmm(m, u, x, schedule=sched)
            check(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_misaligned_operands_fall_back_to_scalar_loads(dtype):
    csr = power_law(5, 100, 80)
    feat = 64
    tdt = getattr(torch, dtype)
    x = torch.randn(80 * feat + 1, device="cuda", dtype=tdt)[1:].view(80, feat)
    u = torch.randn(100 * feat + 1, device="cuda", dtype=tdt)[1:].view(100, feat)
    out = T.poison(torch.empty(100 * feat + 1, device="cuda", dtype=tdt))[1:].view(100, feat)
    x64, u64 = x.double().cpu().numpy(), u.double().cpu().numpy()
    d = DeviceCSR.from_host(csr, dtype)
    for fmt, params in [("csr", {}), ("ell", {}), ("hyb", {"c": 2, "k": 3})]:
        m = to_format(d, fmt, **params)
        check(spmm(m, x, out=out), spmm_want(rounded(csr, dtype), x64), dtype)
        check(sddmm(m, u, x), sddmm_want(csr, u64, x64), dtype)


def test_with_values_reuses_the_layout():
    csr = power_law(7, 200, 150)
    rng = np.random.default_rng(8)
    d = DeviceCSR.from_host(csr)
    x, x64 = dense_operand(rng, (150, 32), "float32")
    new = rng.standard_normal(csr.nnz)
    new_csr = fm.CSR(csr.shape, csr.indptr, csr.indices, new.astype(np.float32))
    for fmt, params in [("csr", {}), ("ell", {}), ("bsr", {"block": 8}), ("hyb", {"c": 2, "k": 2})]:
        m = to_format(d, fmt, **params).with_values(
            torch.from_numpy(new.astype(np.float32)).cuda())
        check(spmm(m, x), spmm_want(new_csr, x64), "float32")


def test_row_stats_and_to_torch():
    csr = power_law(9, 300, 200)
    d = DeviceCSR.from_host(csr)
    s = d.row_stats()
    lengths = csr.row_lengths()
    assert (s["rows"], s["cols"], s["nnz"], s["max_row"]) == (300, 200, csr.nnz, lengths.max())
    assert s["mean_row"] == pytest.approx(lengths.mean())
    assert s["std_row"] == pytest.approx(lengths.std())
    assert s["empty_fraction"] == pytest.approx((lengths == 0).mean())
    np.testing.assert_allclose(d.to_torch().to_dense().double().cpu().numpy(), csr.to_dense(),
                               rtol=1e-6)
    assert DeviceCSR.from_scipy(pytest.importorskip("scipy.sparse").csr_matrix(
        csr.to_dense())).nnz == csr.nnz


def test_bad_input_raises_pitgen_errors():
    csr = power_law(10, 50, 40)
    d = DeviceCSR.from_host(csr)
    x = torch.randn(40, 32, device="cuda")
    with pytest.raises(ShapeError, match="dtype"):
        spmm(d, x.half())
    with pytest.raises(ShapeError, match="shape"):
        spmm(d, torch.randn(41, 32, device="cuda"))
    with pytest.raises(DeviceError):
        spmm(d, x.cpu())
    with pytest.raises(ShapeError, match="shape"):
        spmm(d, x, out=torch.empty(50, 31, device="cuda"))
    with pytest.raises(ShapeError, match="shape"):
        sddmm(d, torch.randn(50, 32, device="cuda"), torch.randn(40, 16, device="cuda"))
    with pytest.raises(PlanError, match="unknown sparse format"):
        to_format(d, "coo")
    with pytest.raises(PlanError, match="block"):
        to_format(d, "bsr", block=5)
    with pytest.raises(PlanError, match="hyb"):
        to_format(d, "hyb", c=9, k=2)
    with pytest.raises(PlanError, match="parameters"):
        to_format(d, "ell", block=8)
    with pytest.raises(ShapeError, match="too small"):
        to_format(d, "ell", width=1)
    with pytest.raises(PlanError, match="unknown"):
        spmm(d, x, schedule={"warps": 4})
    with pytest.raises(PlanError, match="group"):
        spmm(d, x, schedule={"group": 3})
    with pytest.raises(ShapeError, match="int32"):
        DeviceCSR(d.shape, d.indptr.long(), d.indices, d.values)
    with pytest.raises(ShapeError, match="value dtype"):
        DeviceCSR.from_host(csr, "float64")
