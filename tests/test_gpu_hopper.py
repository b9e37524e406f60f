"""GPU tests of the Hopper (sm_90a) wgmma tile kernel and of the mma.sync kernel on the same
device, against float64 references (marker ``gpu``; skipped off Hopper). Extents are drawn so
that TMA can map the operands (rows 16-byte multiples), which the property test in test_gpu.py
reaches only now and then; each draw also asserts which mainloop ran."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pitgen
from pitgen import lower
from pitgen import testing as T
from pitgen.lower import Schedule
from pitgen.operands import as_operand
from pitgen.ops.matmul import GemmCall, Launcher

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="GPU tests need torch")

FORMS = {"A": "C[m,n] += A[m,k] * B[k,n]", "At": "C[m,n] += A[k,m] * B[k,n]",
         "Bt": "C[m,n] += A[m,k] * B[n,k]"}


@pytest.fixture(scope="module", autouse=True)
def _hopper():
    try:
        from pitgen.runtime import device_arch
        arch = device_arch()
    except pitgen.PitgenError as e:
        pytest.skip(str(e))
    if arch not in lower.WGMMA_ARCHS:
        pytest.skip(f"the wgmma kernel needs a Hopper GPU (this one is {arch})")


def _operands(rng, form, M, N, K, dtype, mask):
    op = pitgen.parse(FORMS[form])
    shapes = {"A": (M, K) if op.access("A").axes[0] == "m" else (K, M),
              "B": (K, N) if op.access("B").axes[0] == "k" else (N, K)}
    arrays = {}
    for name, shp in shapes.items():
        x = rng.standard_normal(shp).astype(np.float32)
        if name == "A":
            x = x * (mask(shp) if op.access("A").axes[0] == "m" else mask(shp[::-1]).T)
        arrays[name] = torch.from_numpy(np.ascontiguousarray(x)).to("cuda", getattr(torch, dtype))
    host = {n: t.double().cpu().numpy() for n, t in arrays.items()}
    ref = pitgen.evaluate(op, host)
    scale = T.term_scale(lambda a, b: pitgen.evaluate(op, {"A": a, "B": b}), host["A"], host["B"])
    return op, arrays, ref, scale


def _output(M, N, dtype, ref, scale, accumulate):
    """(out, reference, scale): a random C to add to (with the reference and scale adding it),
    or a poisoned one."""
    tdt = getattr(torch, dtype)
    if not accumulate:
        return T.poison(torch.empty(M, N, dtype=tdt, device="cuda")), ref, scale
    out = torch.randn(M, N, device="cuda").to(tdt)
    c = out.double().cpu().numpy()
    return out, ref + c, scale + np.abs(c)


mult8 = st.integers(1, 66).map(lambda v: 8 * v)


@pytest.mark.parametrize("mainloop", ["pingpong", "split", "mma_sync"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@settings(max_examples=T.examples(12, share=2), deadline=None,   # 2 dtypes per mainloop
          suppress_health_check=list(HealthCheck))
@given(form=st.sampled_from(sorted(FORMS)), kind=st.sampled_from(["dense", "block"]),
       M=mult8, N=mult8, K=mult8, t_m=st.sampled_from([64, 128]), t_k=st.sampled_from([64, 128]),
       density=st.sampled_from([0.0, 0.2, 0.6, 1.0]), accumulate=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_hopper_kernel_matches_float64_reference(monkeypatch, mainloop, dtype, form, kind, M, N, K,
                                                 t_m, t_k, density, accumulate, seed):
    if mainloop == "mma_sync":
        monkeypatch.setattr(lower, "WGMMA_ARCHS", ())
    else:  # the wgmma kernel's two consumer schedules
        monkeypatch.setattr(lower, "PINGPONG", "always" if mainloop == "pingpong" else "never")
    rng = np.random.default_rng(seed)
    op, arrays, ref, scale = _operands(rng, form, M, N, K, dtype,
                                lambda shp: T.tile_mask(rng, shp[0], shp[1], (t_m, t_k), density))
    micro = "dense" if kind == "dense" else (
        (t_m, t_k) if op.access("A").axes[0] == "m" else (t_k, t_m))
    kern = pitgen.compile(op, sparse="A", dtype=dtype, micro_tile=micro, vendor_dense=False)
    out, ref, scale = _output(M, N, dtype, ref, scale, accumulate)
    call = kern.prepare(**arrays, out=out, accumulate=accumulate)
    g = call.L.spec.gemm
    assert (g.mainloop, g.pingpong) == (("mma_sync", False) if mainloop == "mma_sync"
                                        else ("wgmma", mainloop == "pingpong"))
    assert call.run() is out
    T.assert_close(out, ref, dtype, scale=scale)


@pytest.mark.parametrize("order_local", [0, 2, 256])
def test_tile_counter_and_m_tile_order(monkeypatch, order_local):
    """Block plans draw their tiles from a counter that the CTA drawing the last number resets
    (a CTA's first tile is its own number; 33 x 5 tiles here, more than an H100's or H200's
    132 CTAs, so most CTAs draw again), in an m-tile order the tile kernel forms itself up to
    lower.ORDER_LOCAL m-tiles and the index pass's last CTA beyond (0: always the index; 2: the
    index, for the 33 m-tiles here): one index build, then the tile kernel twice on it (the
    output poisoned in between), then steady-state calls (which take the two halves of the
    counts pair in turn) all match."""
    monkeypatch.setattr(lower, "ORDER_LOCAL", order_local)
    rng = np.random.default_rng(7)
    M, N, K = 4100, 1280, 256
    op, arrays, ref, scale = _operands(
        rng, "A", M, N, K, "float16", lambda shp: T.tile_mask(rng, shp[0], shp[1], (128, 128), 0.3))
    kern = pitgen.compile(op, sparse="A", dtype="float16", micro_tile=(128, 128), vendor_dense=False)
    out = T.poison(torch.empty(M, N, dtype=torch.float16, device="cuda"))
    call = kern.prepare(**arrays, out=out)
    g = call.L.spec.gemm
    assert g.mainloop == "wgmma" and g.order_local == order_local and call.L.spec.index.ordered
    call.build_index(None)
    for _ in range(2):
        T.poison(out)
        call.compute(None)
        torch.cuda.synchronize()
        T.assert_close(out, ref, "float16", scale=scale)
    for _ in range(3):
        T.assert_close(kern(**arrays), ref, "float16", scale=scale)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@settings(max_examples=T.examples(16, share=2), deadline=None,   # 2 dtypes
          suppress_health_check=list(HealthCheck))
@given(form=st.sampled_from(sorted(FORMS)), M=st.integers(1, 1100), N=mult8, K=mult8,
       t_k=st.sampled_from([64, 128]), density=st.sampled_from([0.0, 0.02, 0.3, 1.0]),
       bm=st.sampled_from([None, 64, 256]), accumulate=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_rows_kernel_matches_float64_reference(dtype, form, M, N, K, t_k, density, bm, accumulate,
                                               seed):
    """Micro-tiles 1 x t_k along m: the wgmma row-owner kernel wherever A' is k-contiguous
    (forms A and Bt), the mma.sync one otherwise (At); ragged M, empty and full masks, row
    blocks of 64 to 512 rows, B' n- and k-contiguous."""
    rng = np.random.default_rng(seed)
    op, arrays, ref, scale = _operands(rng, form, M, N, K, dtype,
                                       lambda shp: T.tile_mask(rng, shp[0], shp[1], (1, t_k), density))
    micro = (1, t_k) if op.access("A").axes[0] == "m" else (t_k, 1)
    kern = pitgen.compile(op, sparse="A", dtype=dtype, micro_tile=micro)
    out, ref, scale = _output(M, N, dtype, ref, scale, accumulate)
    call = kern.prepare(**arrays, out=out, accumulate=accumulate)
    if bm is not None:   # another row block: the same launcher with the schedule's BM
        L = call.L
        ops = {n: as_operand(n, t) for n, t in arrays.items()}
        launcher = Launcher(op, L.form, [("micro", "m", (1, t_k))], dtype, ops,
                            as_operand("out", out), accumulate, Schedule(bm=bm))
        call = GemmCall(launcher, arrays["A"], arrays["B"], out)
    g = call.L.spec.gemm
    assert g.a_mode == "rows" and g.mainloop == ("mma_sync" if form == "At" else "wgmma")
    assert bm is None or g.bm == bm
    assert call.run() is out
    T.assert_close(out, ref, dtype, scale=scale)
