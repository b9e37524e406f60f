"""GPU tests of the tuner and of format kernels (``pitgen.compile(..., format=...)``) against
float64 NumPy references (pitgen.graph.formats.spmm / sddmm)."""
from __future__ import annotations

import os
import time
import warnings

import numpy as np
import pytest

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pitgen
from pitgen import reference as R
from pitgen.errors import FormatWarning
from pitgen.graph import formats as F
from pitgen.graph import model as M
from pitgen.graph import tune as T
from pitgen.testing import assert_close, examples, poison, term_scale

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="GPU tests need torch")

SPMM = "Y[i,f] += A[i,j] * X[j,f]"
SDDMM = "E[i,j] += U[i,f] * V[j,f]"


@pytest.fixture(autouse=True, scope="module")
def tune_cache(tmp_path_factory):
    """A private tune cache: results of other runs never answer these tests."""
    old = os.environ.get("PITGEN_TUNE_CACHE")
    path = tmp_path_factory.mktemp("tune")
    os.environ["PITGEN_TUNE_CACHE"] = str(path)
    yield path
    if old is None:
        del os.environ["PITGEN_TUNE_CACHE"]
    else:
        os.environ["PITGEN_TUNE_CACHE"] = old


def graph(seed: int, rows: int, cols: int, kind: str = "power") -> F.CSR:
    """A pattern with skewed row lengths (some empty rows, one long row that hyb must cut),
    or an empty / full one; random non-zero values."""
    rng = np.random.default_rng(seed)
    if kind == "empty":
        mask = np.zeros((rows, cols), bool)
    elif kind == "full":
        mask = np.ones((rows, cols), bool)
    else:
        p = np.minimum(1.0, (rng.pareto(1.2, rows) + 0.2) * 4.0 / max(cols, 1))
        p[rng.random(rows) < 0.1] = 0.0
        mask = rng.random((rows, cols)) < p[:, None]
        mask[rows // 2, : min(cols, 200)] = True
    vals = rng.uniform(0.5, 1.5, (rows, cols)) * rng.choice([-1.0, 1.0], (rows, cols))
    return F.CSR.from_dense(np.where(mask, vals, 0.0))


def on_device(csr: F.CSR, dtype: str):
    """The DeviceCSR and the host CSR holding exactly its (rounded) values."""
    from pitgen.graph.device import DeviceCSR

    a = DeviceCSR.from_host(csr, dtype)
    host = F.CSR(csr.shape, csr.indptr, csr.indices, a.values.double().cpu().numpy())
    return a, host


def dense(rng, rows: int, feat: int, dtype: str):
    t = torch.from_numpy(rng.standard_normal((rows, feat))).to("cuda", getattr(torch, dtype))
    return t, t.double().cpu().numpy()


def spmm_want(host: F.CSR, x64: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """SpMM's float64 reference and the root-sum-square of each output's terms."""
    return R.spmm_csr(host, x64), term_scale(R.spmm_csr, host, x64)


def sddmm_want(host: F.CSR, u64: np.ndarray, v64: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """SDDMM's float64 reference (CSR order) and the root-sum-square of each edge's terms."""
    return R.sddmm_csr(host, u64, v64), term_scale(R.sddmm_csr, host, u64, v64)


def check(got, want: tuple[np.ndarray, np.ndarray], dtype: str) -> None:
    """Every element within its own bound (float32 CUDA cores or fp32 sums of float16, the
    output rounded to dtype): one dropped term fails."""
    assert_close(got, want[0], dtype, scale=want[1])


def run_choice(res: T.TuneResult, a, op: str, args):
    from pitgen.graph import kernels as graph_ops
    from pitgen.graph.device import to_format

    m = to_format(a, res.fmt, **res.params)
    if op == "spmm":
        return graph_ops.spmm(m, *args, schedule=res.schedule)
    return graph_ops.sddmm(m, *args, schedule=res.schedule)


@pytest.mark.parametrize("op", ["spmm", "sddmm"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_tune_matches_reference_and_caches(op, dtype, tune_cache, monkeypatch):
    rng = np.random.default_rng(1)
    csr = graph(3, 333, 301)
    a, host = on_device(csr, dtype)
    feat = 40
    if op == "spmm":
        x, x64 = dense(rng, 301, feat, dtype)
        args, ref = (x,), spmm_want(host, x64)
    else:
        (u, u64), (v, v64) = dense(rng, 333, feat, dtype), dense(rng, 301, feat, dtype)
        args, ref = (u, v), sddmm_want(host, u64, v64)
    before = set(tune_cache.iterdir())
    res = T.tune(a, op, feat, dtype, budget_s=3.0)
    assert res.fmt in T.FORMATS and res.ms > 0 and res.trials >= 1 and not res.from_cache
    assert res.search_s > 0 and res.csr_ms is not None and res.speedup > 0
    ok = [t for t in res.log if t.status == "ok"]
    assert ok and all(t.ms > 0 for t in ok) and min(t.ms for t in ok) == res.ms
    check(run_choice(res, a, op, args), ref, dtype)
    new = set(tune_cache.iterdir()) - before
    assert len(new) == 1 and next(iter(new)).suffix == ".json"

    def no_timing(*_a, **_k):
        raise AssertionError("a cache hit must not time anything")
    monkeypatch.setattr(T, "_GpuMeasure", no_timing)
    hit = T.lookup(a, op, feat, dtype)
    assert hit.from_cache and (hit.fmt, hit.params, hit.schedule) == (res.fmt, res.params,
                                                                       res.schedule)
    check(run_choice(hit, a, op, args), ref, dtype)
    # format="auto" prefers the cached tuned result over the model, with or without tune=True
    for search in (False, True):
        c = M.plan(a, op, feat, dtype, tune_search=search)
        assert c.source == "cache" and (c.fmt, c.params, c.schedule) == (res.fmt, res.params,
                                                                          res.schedule)


def test_tune_small_budget_still_answers():
    csr = graph(5, 120, 90)
    a, _ = on_device(csr, "float32")
    res = T.tune(a, "spmm", 16, "float32", budget_s=1e-3, cache=False)
    assert res.trials == 1 and res.fmt == "csr"


@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 200), cols=st.integers(1, 200),
       feat=st.sampled_from([1, 3, 16, 33, 64]), kind=st.sampled_from(["power", "power", "empty",
                                                                       "full"]),
       fmt=st.sampled_from(["csr", "ell", "bsr", "hyb", "auto", "auto"]),
       search=st.booleans(),
       dtype=st.sampled_from(["float32", "float16"]), op=st.sampled_from(["spmm", "sddmm"]))
def test_compile_format_matches_reference(seed, rows, cols, feat, kind, fmt, search, dtype, op):
    """Every format, and auto from the model or (tune=True) from a short search."""
    rng = np.random.default_rng(seed)
    csr = graph(seed, rows, cols, kind)
    a, host = on_device(csr, dtype)
    opts = {"tune": True, "budget_s": 0.5} if fmt == "auto" and search else {}
    warnings.simplefilter("ignore", FormatWarning)   # ELL / BSR on skewed rows: warned, run
    if op == "spmm":
        k = pitgen.compile(SPMM, sparse="A", format=fmt, dtype=dtype, **opts)
        x, x64 = dense(rng, cols, feat, dtype)
        out = poison(torch.empty((rows, feat), dtype=x.dtype, device="cuda"))
        got = k(a, x, out=out)
        assert got.data_ptr() == out.data_ptr()
        ref = spmm_want(host, x64)
    else:
        k = pitgen.compile(SDDMM, sparse="E", format=fmt, dtype=dtype, **opts)
        (u, u64), (v, v64) = dense(rng, rows, feat, dtype), dense(rng, cols, feat, dtype)
        got = k(u, v, sample=a)
        assert tuple(got.shape) == (csr.nnz,)
        ref = sddmm_want(host, u64, v64)
    check(got, ref, dtype)


@pytest.mark.parametrize("source", ["device", "torch_sparse", "host_csr", "scipy", "dense"])
def test_matrix_sources_and_conversion_once(source, monkeypatch):
    import pitgen.graph.jit as gj  # the format kernel converts through its to_format

    dtype = "float32"
    csr = graph(7, 150, 130)
    a, host = on_device(csr, dtype)
    m = {"device": a, "torch_sparse": a.to_torch(), "host_csr": host,
         "dense": a.to_torch().to_dense()}.get(source)
    if source == "scipy":
        sp = pytest.importorskip("scipy.sparse")
        m = sp.csr_matrix((host.data, host.indices, host.indptr), shape=host.shape)
    calls = []
    real = gj.to_format
    monkeypatch.setattr(gj, "to_format", lambda *a_, **k_: calls.append(a_[1:]) or real(*a_, **k_))
    k = pitgen.compile(SPMM, sparse="A", format="hyb", dtype=dtype)
    rng = np.random.default_rng(0)
    x, x64 = dense(rng, 130, 24, dtype)
    ref = spmm_want(host, x64)
    for _ in range(3):
        check(k(m, x), ref, dtype)
    assert len(calls) == 1 and calls[0][0] == "hyb"
    x2, x2_64 = dense(rng, 130, 8, dtype)           # another feature width: same conversion
    check(k(A=m, X=x2), spmm_want(host, x2_64), dtype)


def test_sddmm_of_torch_sparse_and_empty_graph():
    dtype = "float16"
    k = pitgen.compile(SDDMM, sparse="E", format="csr", dtype=dtype)
    rng = np.random.default_rng(2)
    for csr in (graph(1, 64, 48), graph(1, 64, 48, "empty")):
        a, host = on_device(csr, dtype)
        (u, u64), (v, v64) = dense(rng, 64, 32, dtype), dense(rng, 48, 32, dtype)
        got = k(U=u, V=v, sample=a.to_torch())
        assert got.shape == (csr.nnz,)
        if csr.nnz:
            check(got, sddmm_want(host, u64, v64), dtype)


def test_bad_inputs_raise_pitgen_errors():
    dtype = "float32"
    csr = graph(4, 50, 40)
    a, _ = on_device(csr, dtype)
    a16, _ = on_device(csr, "float16")
    x = torch.randn(40, 8, device="cuda")
    spmm = pitgen.compile(SPMM, sparse="A", format="csr", dtype=dtype)
    sddmm = pitgen.compile(SDDMM, sparse="E", format="ell", dtype=dtype)
    u, v = torch.randn(50, 8, device="cuda"), torch.randn(40, 8, device="cuda")
    cases = [
        (pitgen.DeviceError, "cpu", lambda: spmm(a, x.cpu())),
        (pitgen.ShapeError, "dtype float16", lambda: spmm(a, x.half())),
        (pitgen.ShapeError, "rows", lambda: spmm(a, torch.randn(41, 8, device="cuda"))),
        (pitgen.ShapeError, "build it with dtype='float32'", lambda: spmm(a16, x)),
        (pitgen.ShapeError, "expected a DeviceCSR", lambda: spmm(csr.to_dense(), x)),
        (pitgen.ShapeError, "missing operand", lambda: spmm(a)),
        (pitgen.ShapeError, "sample= is for SDDMM", lambda: spmm(a, x, sample=a)),
        (pitgen.ShapeError, "needs the edge pattern", lambda: sddmm(u, v)),
        (pitgen.ShapeError, "same feature width",
         lambda: sddmm(u, torch.randn(40, 9, device="cuda"), sample=a)),
        (pitgen.ShapeError, "needs 40", lambda: sddmm(u, u, sample=a)),
        (pitgen.ShapeError, "out= is for SpMM", lambda: sddmm(u, v, sample=a, out=u)),
        (pitgen.ShapeError, "feature width must be >= 1",
         lambda: spmm(a, torch.randn(40, 0, device="cuda"))),
    ]
    for err, match, fn in cases:
        with pytest.raises(err, match=match):
            fn()
        torch.cuda.synchronize()
    with pytest.raises(pitgen.PlanError):
        T.tune(a, "spmm", 8, dtype, budget_s=1.0, formats=("csr", "coo"))
    with pytest.raises(pitgen.PlanError):
        T.tune(a, "gemm", 8, dtype, budget_s=1.0)


@pytest.mark.parametrize("name,op,dtype,feat", [("ogbn-arxiv", "spmm", "float16", 64),
                                                ("pubmed", "spmm", "float32", 128),
                                                ("cora", "sddmm", "float32", 32)])
def test_auto_plans_within_50ms_from_the_model(name, op, dtype, feat, tune_cache):
    """First sight of a graph: format="auto" plans (row statistics on the GPU, one host sync,
    the model) in at most 50 ms, with no search, and computes the float64 reference. Timed
    after the kernels are compiled (on an equal copy of the graph: compile time is not
    planning), on a fresh matrix object whose statistics nothing has seen."""
    from pitgen.graphs import make_graph

    rng = np.random.default_rng(2)
    g = make_graph(name)
    csr = F.CSR(g.shape, g.indptr, g.indices, rng.uniform(0.5, 1.5, g.nnz))
    if op == "spmm":
        x, x64 = dense(rng, csr.shape[1], feat, dtype)
        ref = spmm_want(on_device(csr, dtype)[1], x64)
    else:
        (u, u64), (v, v64) = dense(rng, csr.shape[0], feat, dtype), \
            dense(rng, csr.shape[1], feat, dtype)
        ref = sddmm_want(on_device(csr, dtype)[1], u64, v64)
    expr, sparse = (SPMM, "A") if op == "spmm" else (SDDMM, "E")
    before = set(tune_cache.iterdir())

    def run(k, a):
        return k(a, x) if op == "spmm" else k(u, v, sample=a)

    run(pitgen.compile(expr, sparse=sparse, format="auto", dtype=dtype),
        on_device(csr, dtype)[0])  # compiles the chosen kernels and conversions
    a, host = on_device(csr, dtype)
    k = pitgen.compile(expr, sparse=sparse, format="auto", dtype=dtype)
    torch.cuda.synchronize()
    t = time.perf_counter()
    fmt, params, sched, _ = k.choice(a, feat)
    plan_ms = (time.perf_counter() - t) * 1e3
    assert plan_ms <= 50.0, f"planning took {plan_ms:.1f} ms"
    c = M.plan(a, op, feat, dtype)
    assert c.source == "model" and (c.fmt, c.params, c.schedule) == (fmt, params, sched)
    check(run(k, a), ref, dtype)
    assert set(tune_cache.iterdir()) == before   # nothing searched, nothing stored


def test_explicit_slow_format_warns_and_names_the_better_one():
    """ELL on a power-law graph (padded to its longest row) and BSR on scattered columns are
    modelled many times slower than hyb: a FormatWarning naming hyb, and the result is still
    right; hyb itself and auto warn nothing."""
    rng = np.random.default_rng(3)
    csr = graph(4, 2000, 2000)   # modelled: ELL 23x hyb (and infeasible), BSR 29x
    a, host = on_device(csr, "float32")
    x, x64 = dense(rng, 2000, 32, "float32")
    for fmt in ("ell", "bsr"):
        k = pitgen.compile(SPMM, sparse="A", format=fmt, dtype="float32")
        with pytest.warns(FormatWarning, match=r"slower than hyb\(c=1"):
            got = k(a, x)
        check(got, spmm_want(host, x64), "float32")
    for fmt in ("hyb", "auto"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", FormatWarning)
            pitgen.compile(SPMM, sparse="A", format=fmt, dtype="float32")(a, x)
