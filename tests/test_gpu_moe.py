"""GPU tests of the fused MoE layer against float64 NumPy references: random shapes (tokens not
multiples of the tiles, T = 1), top-1/top-2, skewed, one-expert and empty routings, every
activation, fp16/bf16/fp32, bad ids skipped without a check, bad input refused; the GPU routing
index against its NumPy reference; the MoE module against a dense PyTorch version of itself."""
from __future__ import annotations

import numpy as np
import pytest

from pitgen import testing as T
from hypothesis import HealthCheck, given, settings, strategies as st

import pitgen
import pitgen.ops.moe as moe_mod
from pitgen import lower
from pitgen.errors import DeviceError, PitgenError, ShapeError
from pitgen.ops.moe import ACTIVATIONS, moe_ffn, moe_route
from pitgen.runtime import device_arch
from pitgen.reference import moe_reference, route_reference
from pitgen.testing import assert_close

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

DT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def check(y, want, dtype: str) -> None:
    """float32 runs two chained tf32 GEMMs with the activation between: 10x tf32's bound."""
    if dtype == "float32":
        assert_close(y, want, "tf32", tol=5e-3)
    else:
        assert_close(y, want, dtype)


@pytest.fixture(autouse=True)
def _fresh_plans():
    """Plans and launches chosen under a test's mainloop do not outlive it."""
    yield
    moe_mod.plan_moe.cache_clear()
    moe_mod._CHECKED.clear()


def _use(mainloop: str, monkeypatch, dtype: str, pairs: int) -> str:
    """Run the next calls on ``mainloop`` (mma_sync: Hopper's wgmma turned off); the mainloop
    the plan will then have on this device."""
    if mainloop == "mma_sync":
        monkeypatch.setattr(lower, "WGMMA_ARCHS", ())
    moe_mod.plan_moe.cache_clear()
    moe_mod._CHECKED.clear()
    hopper = device_arch() in lower.WGMMA_ARCHS
    return "wgmma" if hopper and dtype != "float32" and pairs > 256 else "mma_sync"


def _ran(dev, act) -> str:
    return moe_mod._checked(*dev, act).plan.mainloop


def _ids(rng, T, topk, E, routing):
    if routing == "one":
        ids = np.full((T, topk), E - 1)
        if topk > 1:
            ids[:, 1:] = 0
    elif routing == "skewed":   # Zipf-like popularity: many experts empty at small T
        p = 1.0 / np.arange(1, E + 1) ** 1.2
        ids = rng.choice(E, size=(T, topk), p=p / p.sum())
    else:
        ids = rng.integers(0, E, size=(T, topk))
    return ids


def _layer(rng, T, topk, E, H, F, dtype, bias, routing, id_dtype="int64"):
    dev = "cuda"
    x = rng.standard_normal((T, H))
    w1 = rng.standard_normal((E, H, F)) / np.sqrt(H)
    w2 = rng.standard_normal((E, F, H)) / np.sqrt(F)
    b1 = rng.standard_normal((E, F)) * 0.1 if bias else None
    b2 = rng.standard_normal((E, H)) * 0.1 if bias else None
    gates = rng.random((T, topk)) + 0.1
    ids = _ids(rng, T, topk, E, routing)
    # round the inputs to the device dtype so the reference sees the same numbers
    t = lambda a: None if a is None else torch.tensor(a, device=dev).to(DT[dtype])  # noqa: E731
    tx, tw1, tw2, tb1, tb2 = t(x), t(w1), t(w2), t(b1), t(b2)
    f64 = lambda a: None if a is None else a.double().cpu().numpy()  # noqa: E731
    tids = torch.tensor(ids, device=dev, dtype=getattr(torch, id_dtype))
    tg = torch.tensor(gates, device=dev, dtype=torch.float32)
    return (tx, tids, tg, tw1, tw2, tb1, tb2), (f64(tx), ids, gates, f64(tw1), f64(tw2), f64(tb1), f64(tb2))


@pytest.mark.parametrize("mainloop", ["wgmma", "mma_sync"])
@settings(max_examples=T.examples(15), deadline=None, suppress_health_check=list(HealthCheck))
@given(T=st.sampled_from([1, 7, 64, 97, 300, 1029, 2000]), topk=st.sampled_from([1, 2]),
       E=st.sampled_from([1, 3, 8, 33]), H=st.sampled_from([8, 40, 128, 264]),
       F=st.sampled_from([8, 56, 256, 392]), dtype=st.sampled_from(["float16", "bfloat16"]),
       act=st.sampled_from(ACTIVATIONS), bias=st.booleans(),
       routing=st.sampled_from(["uniform", "skewed", "one"]),
       id_dtype=st.sampled_from(["int32", "int64"]), seed=st.integers(0, 2**16))
def test_moe_ffn_matches_float64(monkeypatch, mainloop, T, topk, E, H, F, dtype, act, bias,
                                 routing, id_dtype, seed):
    expect = _use(mainloop, monkeypatch, dtype, T * topk)
    rng = np.random.default_rng(seed)
    dev, ref = _layer(rng, T, topk, E, H, F, dtype, bias, routing, id_dtype)
    y = moe_ffn(*dev, activation=act)
    assert _ran(dev, act) == expect
    assert y.shape == (T, H) and y.dtype == DT[dtype]
    want = moe_reference(*ref, activation=act)
    check(y, want, dtype)


@pytest.mark.parametrize("topk", [1, 2])
def test_float32_tf32(topk):
    rng = np.random.default_rng(3)
    dev, ref = _layer(rng, 203, topk, 5, 72, 136, "float32", True, "skewed")
    y = moe_ffn(*dev, activation="silu")
    check(y, moe_reference(*ref, activation="silu"), "float32")


@pytest.mark.parametrize("mainloop", ["wgmma", "mma_sync"])
@pytest.mark.parametrize("topk", [1, 2])
def test_large_skewed_bm128(monkeypatch, mainloop, topk):
    """Enough rows per expert for BM = 128 tiles, and experts spanning many tiles."""
    expect = _use(mainloop, monkeypatch, "float16", 2500 * topk)
    rng = np.random.default_rng(4)
    dev, ref = _layer(rng, 2500, topk, 4, 256, 512, "float16", True, "skewed")
    y = moe_ffn(*dev, activation="gelu")
    assert _ran(dev, "gelu") == expect and moe_mod._checked(*dev, "gelu").plan.bm == 128
    check(y, moe_reference(*ref, activation="gelu"), "float16")


@pytest.mark.parametrize("dtype,topk,H,F", [("bfloat16", 1, 264, 392), ("float16", 3, 40, 8),
                                            ("bfloat16", 2, 8, 200)])
def test_hopper_ragged_shapes_and_many_experts(monkeypatch, dtype, topk, H, F):
    """The wgmma path where k and n are not 64-multiples (TMA zero fill, masked stores), many
    experts with a token or two (tiles mostly rows of the next expert) and ids out of range."""
    expect = _use("wgmma", monkeypatch, dtype, 700 * topk)
    rng = np.random.default_rng(11)
    dev, ref = _layer(rng, 700, topk, 300, H, F, dtype, True, "uniform", "int32")
    dev[1][3, 0] = 300
    dev[1][5, -1] = -2
    torch.empty(1 << 24, device="cuda").fill_(float("nan"))  # poison the caching allocator
    y = moe_ffn(*dev, activation="silu", check=False)
    assert _ran(dev, "silu") == expect
    ids = ref[1].copy()
    ids[3, 0], ids[5, -1] = 300, -2
    want = moe_reference(ref[0], ids, *ref[2:], activation="silu")
    check(y, want, dtype)


def test_routing_index_matches_reference():
    rng = np.random.default_rng(5)
    for T, topk, E, bm in ((1000, 2, 16, 64), (1, 1, 3, 64), (777, 1, 300, 128), (50, 2, 2000, 64)):
        ids = _ids(rng, T, topk, E, "skewed")
        ids[0, 0] = E + 5          # out of range: skipped
        ids[-1, -1] = -1
        r, ntiles = moe_route(torch.tensor(ids, device="cuda", dtype=torch.int32), E, bm)
        want = route_reference(ids, E, bm)
        assert np.array_equal(r.counts.cpu().numpy(), want.counts)
        assert np.array_equal(r.offsets.cpu().numpy(), want.offsets)
        n = int(ntiles.item())
        assert n == len(want.tile_e)
        assert np.array_equal(r.tile_e.cpu().numpy()[:n], want.tile_e)
        assert np.array_equal(r.tile_r.cpu().numpy()[:n], want.tile_r)
        rows = r.row_pair.cpu().numpy()
        nrows = want.offsets[-1]
        assert (rows[nrows:] == -1).all()
        for e in range(E):   # any order inside a segment (permutation invariance), same set
            seg = slice(want.offsets[e], want.offsets[e + 1])
            assert np.array_equal(np.sort(rows[seg]), np.sort(want.row_pair[seg]))


@pytest.mark.parametrize("topk", [1, 2])
def test_bad_ids_skipped_without_check(topk):
    """check=False: ids outside [0, E) add nothing and touch nothing out of bounds."""
    rng = np.random.default_rng(6)
    dev, ref = _layer(rng, 150, topk, 6, 64, 128, "float16", True, "uniform", "int64")
    ids = ref[1].copy()
    ids[::3, 0] = 6
    ids[1::5, -1] = -7
    ids[2, 0] = 2**40
    dev = (dev[0], torch.tensor(ids, device="cuda"), *dev[2:])
    y = moe_ffn(*dev, activation="relu", check=False)
    check(y, moe_reference(ref[0], ids, *ref[2:], activation="relu"), "float16")
    with pytest.raises(ShapeError, match="outside"):
        moe_ffn(*dev, activation="relu")


def test_all_ids_invalid_gives_zero():
    rng = np.random.default_rng(7)
    dev, _ = _layer(rng, 33, 1, 4, 16, 32, "bfloat16", True, "uniform")
    y = moe_ffn(dev[0], torch.full_like(dev[1], 9), *dev[2:], check=False)
    assert torch.equal(y, torch.zeros_like(y))


def test_empty_tokens():
    rng = np.random.default_rng(8)
    dev, _ = _layer(rng, 1, 2, 4, 16, 32, "float16", False, "uniform")
    y = moe_ffn(dev[0][:0], dev[1][:0], dev[2][:0], *dev[3:])
    assert y.shape == (0, 16)


def test_gate_dtype_and_result_independent_of_outputs_before():
    """Gates in x's dtype are accepted; a second call on a poisoned allocator gives the same y."""
    rng = np.random.default_rng(9)
    dev, ref = _layer(rng, 130, 2, 5, 48, 96, "float16", True, "skewed")
    torch.empty(1 << 24, device="cuda").fill_(float("nan"))  # poison the caching allocator
    y = moe_ffn(dev[0], dev[1], dev[2].half(), *dev[3:], activation="identity")
    check(y, moe_reference(*ref, activation="identity"), "float16")


def test_bad_input_is_refused():
    rng = np.random.default_rng(10)
    (x, ids, g, w1, w2, b1, b2), _ = _layer(rng, 20, 2, 4, 16, 32, "float16", True, "uniform")
    cases = [
        ((x.float(), ids, g, w1, w2), ShapeError, "w1 has dtype"),
        ((x, ids.float(), g, w1, w2), ShapeError, "expert_ids has dtype"),
        ((x, ids[:5], g, w1, w2), ShapeError, "expert_ids has shape"),
        ((x, ids, g[:, :1], w1, w2), ShapeError, "gates has shape"),
        ((x, ids, g, w1, w2[:, :8]), ShapeError, "w2 has shape"),
        ((x.t(), ids, g, w1, w2), ShapeError, "x"),
        ((x[:, :12], ids, g, w1[:, :12], w2[:, :, :12].contiguous()), ShapeError, "contiguous"),
        ((x.cpu(), ids, g, w1, w2), DeviceError, "x"),
        ((x, ids, torch.full_like(g, float("nan")), w1, w2), ShapeError, "NaN"),
    ]
    for args, err, msg in cases:
        with pytest.raises(err, match=msg):
            moe_ffn(*args)
    with pytest.raises(ShapeError, match="multiple of 8"):
        moe_ffn(x[:, :12].contiguous(), ids, g, w1[:, :12].contiguous(), w2[:, :, :12].contiguous())
    with pytest.raises(ShapeError, match="b1 has shape"):
        moe_ffn(x, ids, g, w1, w2, b1=b1[:, :8])
    with pytest.raises(PitgenError, match="activation"):
        moe_ffn(x, ids, g, w1, w2, activation="tanh")
    with pytest.raises(ShapeError, match="aligned"):
        flat = torch.randn(20 * 16 + 1, device="cuda", dtype=torch.float16)
        moe_ffn(flat[1:].view(20, 16), ids, g, w1, w2)


def _dense_module_reference(m, x):
    """The same module in float64 PyTorch: router, softmax, top-k, one dense FFN per expert."""
    x2 = x.reshape(-1, m.hidden)
    probs = torch.softmax(m.router(x2).float(), dim=-1)
    gates, ids = probs.topk(m.topk, dim=-1)
    xd = x2.double()
    y = torch.zeros_like(xd)
    act = {"relu": torch.relu, "gelu": lambda v: torch.nn.functional.gelu(v, approximate="tanh"),
           "silu": torch.nn.functional.silu, "identity": lambda v: v}[m.activation]
    for e in range(m.num_experts):
        h = act(xd @ m.w1[e].double() + m.b1[e].double()) @ m.w2[e].double() + m.b2[e].double()
        w = (gates.double() * (ids == e)).sum(-1, keepdim=True)
        y += w * h
    return y.reshape(x.shape)


@pytest.mark.parametrize("topk,act,dtype", [(1, "gelu", "float16"), (2, "silu", "bfloat16"),
                                            (2, "relu", "float16")])
def test_module_matches_dense_reference(topk, act, dtype):
    torch.manual_seed(11)
    m = pitgen.ops.moe.MoE(96, 160, 8, topk=topk, activation=act, device="cuda", dtype=DT[dtype])
    with torch.no_grad():
        m.b1.normal_(0, 0.1)
        m.b2.normal_(0, 0.1)
        x = torch.randn(3, 37, 96, device="cuda", dtype=DT[dtype])
        y = m(x)
        ref = _dense_module_reference(m, x)
    assert y.shape == x.shape and y.dtype == x.dtype
    check(y, ref.cpu().numpy(), dtype)
    sd = m.state_dict()
    assert set(sd) == {"router.weight", "w1", "w2", "b1", "b2"}
    assert sd["w1"].shape == (8, 96, 160) and sd["w2"].shape == (8, 160, 96)
    assert sd["router.weight"].shape == (8, 96)


def test_module_runs_in_another_stream_without_sync():
    torch.manual_seed(12)
    m = pitgen.ops.moe.MoE(64, 128, 4, topk=2, bias=False, device="cuda", dtype=torch.float16)
    x = torch.randn(100, 64, device="cuda", dtype=torch.float16)
    s = torch.cuda.Stream()
    with torch.no_grad():
        ref = m(x)
        with torch.cuda.stream(s):
            y = m(x)
        torch.cuda.current_stream().wait_stream(s)
    if not torch.equal(y, ref):   # the same kernels: at most atomics' order differs
        assert_close(y, ref.double().cpu().numpy(), "float16", tol=1e-3)
