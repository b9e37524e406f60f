"""GPU tests of the MoE backward's kernels against float64 references: ``moe_rows`` (each tile's
rows times its expert's weight, both layouts, with and without a bias; tiles past the list's
length and experts out of range give zeros), ``moe_rows_act`` (the activation's backward in its
epilogue, every activation, G · a added into dgates by pair and dh's tile sums into db1),
``moe_wgrad`` (one GEMM per expert over its rows; ragged, empty, reversed and out-of-range row
bounds) and ``moe_gather`` (a chunk's rows, gates, pairs and bias sums from the routing index,
against the same bookkeeping in torch ops), over random shapes that are not tile multiples, with
their outputs' memory poisoned first and the sums they add into holding random values; bad
input refused. The whole backward against float64 autograd
is in test_gpu_autograd.py."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pitgen import testing as T
from pitgen.errors import ShapeError
from pitgen.ops import moe

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

DT = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _poisoned(shape, dtype=torch.float32, count: int = 1) -> set[int]:
    """Leave ``count`` NaN-filled blocks of ``shape`` in torch's cache, for the next
    allocations of that size (the kernel's outputs) to take; their addresses."""
    blocks = [T.poison(torch.empty(shape, dtype=dtype, device="cuda")) for _ in range(count)]
    return {t.data_ptr() for t in blocks}


def _tiles(data, nt: int, E: int):
    """A tile list's experts (some out of range: zero rows), its valid length, and a chunk of
    its slots s .. c."""
    experts = np.asarray(data.draw(st.lists(st.integers(0, E - 1), min_size=nt, max_size=nt)))
    bad = data.draw(st.lists(st.sampled_from([-1, E, 12345]), max_size=nt))
    experts[:len(bad)] = bad
    s = data.draw(st.integers(0, nt - 1))
    return experts, data.draw(st.integers(0, nt)), s, data.draw(st.integers(s + 1, nt))


def _act64(name: str, h: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """act(h), act'(h) in float64 (GELU's tanh form), and the terms the kernel's tanh.approx
    (relative error ~2^-11) may move them by, in units of 2^-10 (assert_close's e_acc)."""
    if name == "gelu":
        c = np.sqrt(2 / np.pi)
        t = np.tanh(c * (h + 0.044715 * h ** 3))
        d = 0.5 * (1 + t) + 0.5 * h * (1 - t * t) * c * (1 + 3 * 0.044715 * h * h)
        return 0.5 * h * (1 + t), d, (1 + np.abs(h)) * (1 + 0.15 * h * h)
    if name == "silu":
        sg = 1 / (1 + np.exp(-h))
        return h * sg, sg * (1 + h * (1 - sg)), np.zeros_like(h)
    if name == "relu":
        return np.maximum(h, 0), (h > 0).astype(np.float64), np.zeros_like(h)
    return h, np.ones_like(h), np.zeros_like(h)


@settings(max_examples=T.examples(25), deadline=None, suppress_health_check=list(HealthCheck))
@given(dtype=st.sampled_from(sorted(DT)), E=st.integers(1, 5),
       K=st.sampled_from([8, 24, 72, 136, 200]), N=st.sampled_from([8, 40, 128, 136, 264]),
       tile_rows=st.sampled_from([64, 128]), nt=st.integers(1, 4), trans=st.booleans(),
       bias=st.booleans(), data=st.data())
def test_expert_rows_matches_float64(dtype, E, K, N, tile_rows, nt, trans, bias, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    experts, ntiles, s, c = _tiles(data, nt, E)
    R = (c - s) * tile_rows
    a = rng.standard_normal((R, K)).astype(np.float32)
    w = rng.standard_normal((E, N, K) if trans else (E, K, N)).astype(np.float32)
    at, wt = (torch.from_numpy(v).to("cuda", DT[dtype]) for v in (a, w))
    a64, w64 = at.double().cpu().numpy(), wt.double().cpu().numpy()
    b = rng.standard_normal((E, N)).astype(np.float32) if bias else np.zeros((E, N))
    bt = torch.from_numpy(b).cuda() if bias else None
    tile_e = torch.tensor(experts, dtype=torch.int32, device="cuda")
    n = torch.tensor([ntiles], dtype=torch.int32, device="cuda")
    ptr = _poisoned((R, N))   # last: no operand takes a poisoned block
    out = moe.expert_rows(at, wt, tile_e, n, s * tile_rows, tile_rows, trans, bt)
    assert {out.data_ptr()} == ptr and out.dtype == torch.float32 and out.shape == (R, N)
    ref, rss = np.zeros((R, N)), np.zeros((R, N))
    for r in range(R):
        slot = s + r // tile_rows
        e = experts[slot]
        if slot < ntiles and 0 <= e < E:   # a live tile's rows: the product and its bias
            we = w64[e].T if trans else w64[e]
            ref[r], rss[r] = a64[r] @ we + b[e], np.sqrt(a64[r] ** 2 @ we ** 2) + np.abs(b[e])
    T.assert_close(out, ref, "float32", scale=rss)


@settings(max_examples=T.examples(25), deadline=None, suppress_health_check=list(HealthCheck))
@given(dtype=st.sampled_from(sorted(DT)), act=st.sampled_from(moe.ACTIVATIONS),
       E=st.integers(1, 4), K=st.sampled_from([8, 72, 136]), N=st.sampled_from([8, 40, 136, 264]),
       tile_rows=st.sampled_from([64, 128]), nt=st.integers(1, 3), data=st.data())
def test_expert_rows_act_matches_float64(dtype, act, E, K, N, tile_rows, nt, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    experts, ntiles, s, c = _tiles(data, nt, E)
    R = (c - s) * tile_rows
    dy = torch.from_numpy(rng.standard_normal((R, K)).astype(np.float32)).to("cuda", DT[dtype])
    w = torch.from_numpy(rng.standard_normal((E, N, K)).astype(np.float32)).to("cuda", DT[dtype])
    h = torch.from_numpy(rng.standard_normal((R, N)).astype(np.float32) * 2).cuda()
    gate = torch.from_numpy(rng.random(R).astype(np.float32)).cuda()
    tile_e = torch.tensor(experts, dtype=torch.int32, device="cuda")
    n = torch.tensor([ntiles], dtype=torch.int32, device="cuda")
    # rows' pairs: repeats, and ids outside [0, P) (skipped); the sums hold random values
    P = data.draw(st.integers(1, 2 * R))
    pair = rng.integers(-2, P + 2, R)
    dg0 = rng.standard_normal(P).astype(np.float32)
    db10 = rng.standard_normal((E, N)).astype(np.float32)
    dg, db1 = torch.from_numpy(dg0).cuda(), torch.from_numpy(db10).cuda()
    pt = torch.from_numpy(pair.astype(np.int32)).cuda()
    ptrs = _poisoned((R, N), DT[dtype], 2)   # last: no operand takes a poisoned block
    dh, a = moe.expert_rows_act(dy, w, h, gate, tile_e, n, s * tile_rows, tile_rows, act, pt,
                                dg, db1)
    assert {dh.data_ptr(), a.data_ptr()} == ptrs and dh.dtype == a.dtype == DT[dtype]
    dy64, w64, h64, g64 = (t.double().cpu().numpy() for t in (dy, w, h, gate))
    G, rss = np.zeros((R, N)), np.zeros((R, N))
    live = np.zeros(R, dtype=bool)
    for r in range(R):
        slot = s + r // tile_rows
        e = experts[slot]
        if slot < ntiles and 0 <= e < E:
            G[r], rss[r] = dy64[r] @ w64[e].T, np.sqrt(dy64[r] ** 2 @ w64[e].T ** 2)
            live[r] = True
    a64, d64, approx = _act64(act, h64)
    # a from h alone; dh, G · a: G's terms times act'(h), act(h), and tanh.approx's allowance
    T.assert_close(a, a64, dtype, scale=np.abs(a64) + approx)
    T.assert_close(dh, d64 * g64[:, None] * G, dtype,
                   scale=(np.abs(d64) * rss + approx * np.abs(G)) * g64[:, None])
    dot, dot_scale = (G * a64).sum(1), ((rss * a64) ** 2 + (approx * G) ** 2).sum(1)
    ok = (pair >= 0) & (pair < P)
    want, scale2 = dg0.astype(np.float64), np.zeros(P)
    np.add.at(want, pair[ok], dot[ok])
    np.add.at(scale2, pair[ok], dot_scale[ok])
    T.assert_close(dg, want, dtype, scale=np.sqrt(scale2) + np.abs(dg0))
    # db1: each live tile's rows of dh as stored, summed in float32
    dh64 = dh.double().cpu().numpy()
    want1, mag = db10.astype(np.float64), np.abs(db10).astype(np.float64)
    for r in np.flatnonzero(live):
        e = experts[s + r // tile_rows]
        want1[e] += dh64[r]
        mag[e] += np.abs(dh64[r])
    assert not db1.isnan().any()
    assert np.all(np.abs(db1.double().cpu().numpy() - want1) <= 1e-5 * mag + 1e-30), "db1"


@settings(max_examples=T.examples(25), deadline=None, suppress_health_check=list(HealthCheck))
@given(dtype=st.sampled_from(sorted(DT)), E=st.integers(1, 6),
       R=st.sampled_from([0, 1, 64, 100, 320]), M=st.sampled_from([8, 40, 136, 264]),
       N=st.sampled_from([8, 56, 128, 200]), tile_rows=st.sampled_from([0, 0, 64, 128]),
       data=st.data())
def test_wgrad_matches_float64(dtype, E, R, M, N, tile_rows, data):
    """Bounds as given (tile_rows 0), or pair offsets whose counts round up to whole tiles."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    # ascending bounds mostly; some reversed, negative or past R (clamped: empty or cut)
    rows = np.sort(rng.integers(0, R + 1, E + 1))
    rows[0] = 0
    if data.draw(st.booleans()):
        rows[rng.integers(0, E + 1)] = data.draw(st.sampled_from([-5, R + 40, 10**6]))
    a = rng.standard_normal((R, M)).astype(np.float32)
    b = rng.standard_normal((R, N)).astype(np.float32)
    at, bt = (torch.from_numpy(v).to("cuda", DT[dtype]) for v in (a, b))
    a64, b64 = at.double().cpu().numpy(), bt.double().cpu().numpy()
    bounds = torch.tensor(rows, dtype=torch.int32, device="cuda")
    ptr = _poisoned((E, M, N), DT[dtype])
    out = moe.wgrad(at, bt, bounds, E, tile_rows)
    assert {out.data_ptr()} == ptr and out.shape == (E, M, N) and out.dtype == DT[dtype]
    ref, rss = np.zeros((E, M, N)), np.zeros((E, M, N))
    start = 0   # tile_rows > 0: the rounded counts of the experts before e
    for e in range(E):
        if tile_rows:
            span = -(-max(int(rows[e + 1]) - int(rows[e]), 0) // tile_rows) * tile_rows
            r0 = min(start, R)
            r1, start = min(r0 + span, R), start + span
        else:
            r0 = min(max(rows[e], 0), R)
            r1 = min(max(rows[e + 1], r0), R)
        ref[e] = a64[r0:r1].T @ b64[r0:r1]
        rss[e] = np.sqrt(a64[r0:r1].T ** 2 @ b64[r0:r1] ** 2)
    T.assert_close(out, ref, dtype, scale=rss)


def _gather_reference(x, dy, gf, b2f, row_pair, tile_e, tile_r, offsets, ntiles, s, C, bm,
                      topk):
    """The rows' bookkeeping in torch ops (what moe_backward ran before moe_gather)."""
    P, E = gf.shape[0], offsets.shape[0] - 1
    i64 = torch.int64
    live = torch.arange(s, s + C, device="cuda") < ntiles.to(i64)
    e = torch.where(live, tile_e[s:s + C].to(i64), 0).clamp(0, E - 1)
    rows = torch.where(live, tile_r[s:s + C].to(i64), 0)[:, None] + torch.arange(bm, device="cuda")
    ok = live[:, None] & (rows < offsets.to(i64)[e + 1][:, None]) & (rows < P)
    pair = row_pair.to(i64)[rows.clamp(0, P - 1)]
    ok &= (pair >= 0) & (pair < P)
    pair = torch.where(ok, pair, 0)
    tok = pair // topk
    okc = ok.to(x.dtype)[..., None]
    xg, dyg = x[tok] * okc, dy[tok] * okc
    gate = gf[pair] * ok
    dyf = dyg.float()
    do = dyf * gate[..., None]
    dot = (dyf * b2f[e][:, None, :]).sum(-1) if b2f is not None else torch.zeros_like(gate)
    # the sums moe_gather adds into: dgates' bias terms by pair, db2 by each tile's expert
    dg = torch.zeros(P, device="cuda").index_add_(0, pair.reshape(-1), dot.reshape(-1))
    db2 = torch.zeros(E, x.shape[1], device="cuda").index_add_(0, e, do.sum(1))
    pair = torch.where(ok, pair, -1)   # a zero row has no pair (its token is 0)
    return (xg.reshape(C * bm, -1), dyg.reshape(C * bm, -1), do.to(x.dtype).reshape(C * bm, -1),
            gate.reshape(-1), pair.reshape(-1), tok.reshape(-1), dg, db2)


@settings(max_examples=T.examples(25), deadline=None, suppress_health_check=list(HealthCheck))
@given(dtype=st.sampled_from(sorted(DT)), T_=st.integers(1, 300), topk=st.integers(1, 3),
       E=st.integers(1, 6), H=st.sampled_from([8, 40, 256, 264, 776]), bm=st.sampled_from([64, 128]),
       bias=st.booleans(), data=st.data())
def test_gather_rows_matches_torch_bookkeeping(dtype, T_, topk, E, H, bm, bias, data):
    """moe_gather over a chunk of a real routing index (ids out of range dropped by the route),
    with list slots past its length and corrupt pair ids, against the torch ops it replaces:
    rows, pairs and tokens exact; do rounded once as torch rounds it; the float32 sums it adds
    into dgates and db2 (holding random values) to 1e-5 of their magnitude. Outputs' memory
    poisoned first."""
    topk = min(topk, E)
    g = torch.Generator(device="cuda").manual_seed(T_ * 31 + E)
    x = torch.randn(T_, H, device="cuda", generator=g).to(DT[dtype])
    dy = torch.randn(T_, H, device="cuda", generator=g).to(DT[dtype])
    ids = torch.rand(T_, E, device="cuda", generator=g).argsort(1)[:, :topk].int().contiguous()
    if data.draw(st.booleans()):
        ids[0, 0] = E + 2                                  # routed nowhere
    gf = torch.rand(T_ * topk, device="cuda", generator=g) + 0.1
    b2f = torch.randn(E, H, device="cuda", generator=g) if bias else None
    row_pair, tile_e, tile_r, offsets, ntiles = moe.route_tensors(ids, E, bm)
    row_pair, tile_e, tile_r = row_pair.clone(), tile_e.clone(), tile_r.clone()
    if data.draw(st.booleans()) and row_pair.numel() > 1:
        row_pair[1] = T_ * topk + 5                        # a corrupt pair id: a zero row
    nt = tile_e.shape[0]
    s = data.draw(st.integers(0, nt - 1))
    C = data.draw(st.integers(1, nt - s))
    dg0 = torch.randn(T_ * topk, device="cuda", generator=g)
    db20 = torch.randn(E, H, device="cuda", generator=g)
    dg, db2 = dg0.clone(), db20.clone()
    blocks = _poisoned((C * bm, H), DT[dtype], 3)
    got = moe.gather_rows(x, dy, gf, b2f, row_pair, tile_e, tile_r, offsets, ntiles, s * bm,
                          C * bm, bm, topk, dg, db2)
    assert {t.data_ptr() for t in got[:3]} & blocks, "the outputs took none of the poisoned blocks"
    want = _gather_reference(x, dy, gf, b2f, row_pair, tile_e, tile_r, offsets, ntiles, s, C, bm,
                             topk)
    assert len(got) == 6
    for name, a, b in zip(("xg", "dyg", "do", "gate", "pair", "tok"), got, want):
        assert torch.equal(a, b.to(a.dtype)), name
    for name, a, b in (("dg", dg - dg0, want[6]), ("db2", db2 - db20, want[7])):
        assert not a.isnan().any(), name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * (float(b.abs().max()) + 2),
                                   msg=name)


def test_kernels_refuse_bad_input():
    h = torch.float16
    a, w = torch.ones(64, 16, dtype=h, device="cuda"), torch.ones(2, 16, 32, dtype=h, device="cuda")
    te, n = torch.zeros(2, dtype=torch.int32, device="cuda"), torch.ones(1, dtype=torch.int32,
                                                                          device="cuda")
    with pytest.raises(ShapeError, match="dtype"):
        moe.expert_rows(a.float(), w, te, n, 0, 64, False)
    with pytest.raises(ShapeError, match="columns"):
        moe.expert_rows(a, w, te, n, 0, 64, True)   # w [E, N, K] would need K = 32
    with pytest.raises(ShapeError, match="multiples of 64"):
        moe.expert_rows(a[:32], w, te, n, 0, 64, False)
    with pytest.raises(ShapeError, match="tile list"):
        moe.expert_rows(a, w, te, n, 128, 64, False)   # slot 2 of a list of 2
    with pytest.raises(ShapeError, match="multiples of 8"):
        moe.expert_rows(torch.ones(64, 12, dtype=h, device="cuda"),
                        torch.ones(2, 12, 32, dtype=h, device="cuda"), te, n, 0, 64, False)
    with pytest.raises(ShapeError, match="bias has shape"):
        moe.expert_rows(a, w, te, n, 0, 64, False, torch.zeros(2, 16, device="cuda"))
    h32 = torch.zeros(64, 32, device="cuda")
    g = torch.zeros(64, device="cuda")
    wt = w.transpose(1, 2).contiguous()
    sums = (torch.zeros(64, dtype=torch.int32, device="cuda"), torch.zeros(64, device="cuda"),
            torch.zeros(2, 32, device="cuda"))   # pair, dg, db1
    with pytest.raises(ShapeError, match="activation"):
        moe.expert_rows_act(a, wt, h32, g, te, n, 0, 64, "tanh", *sums)
    with pytest.raises(ShapeError, match="shape"):
        moe.expert_rows_act(a, wt, h32[:, :16], g, te, n, 0, 64, "relu", *sums)
    with pytest.raises(ShapeError, match="pair.*dtype"):
        moe.expert_rows_act(a, wt, h32, g, te, n, 0, 64, "relu", sums[0].long(), *sums[1:])
    with pytest.raises(ShapeError, match="db1 has shape"):
        moe.expert_rows_act(a, wt, h32, g, te, n, 0, 64, "relu", *sums[:2], sums[2][:, :16])
    rows = torch.zeros(3, dtype=torch.int32, device="cuda")
    with pytest.raises(ShapeError, match="multiples of 8"):
        moe.wgrad(torch.ones(4, 12, dtype=h, device="cuda"), a[:4], rows, 2)
    with pytest.raises(ShapeError, match="at least 4"):
        moe.wgrad(a, a, rows, 3)
    with pytest.raises(ShapeError, match="dtype"):
        moe.wgrad(a, a.bfloat16(), rows, 2)
    with pytest.raises(ShapeError, match="not contiguous"):
        moe.wgrad(a.t(), a.t(), rows, 2)
    with pytest.raises(ShapeError, match="tile_rows must be >= 0"):
        moe.wgrad(a, a, rows, 2, -64)
    ids = torch.zeros(64, 1, dtype=torch.int32, device="cuda")
    route = moe.route_tensors(ids, 2, 64)
    gf = torch.ones(64, device="cuda")
    dg, db2 = torch.zeros(64, device="cuda"), torch.zeros(2, 16, device="cuda")
    with pytest.raises(ShapeError, match="whole tiles"):
        moe.gather_rows(a, a, gf, None, *route, 0, 32, 64, 1, dg, db2)
    with pytest.raises(ShapeError, match="whole tiles"):
        moe.gather_rows(a, a, gf, None, *route, 64 * route[1].shape[0], 64, 64, 1, dg, db2)
    with pytest.raises(ShapeError, match="dim 0 must be 128"):
        moe.gather_rows(a, a, gf, None, *route, 0, 64, 64, 2, dg, db2)   # gates for topk 1
    with pytest.raises(ShapeError, match="dtype"):
        moe.gather_rows(a, a.bfloat16(), gf, None, *route, 0, 64, 64, 1, dg, db2)
    with pytest.raises(ShapeError, match="b2 has shape"):
        moe.gather_rows(a, a, gf, torch.zeros(3, 16, device="cuda"), *route, 0, 64, 64, 1, dg,
                        db2)
    with pytest.raises(ShapeError, match="dg has shape"):
        moe.gather_rows(a, a, gf, None, *route, 0, 64, 64, 1, dg[:10], db2)
    with pytest.raises(ShapeError, match="db2.*dtype"):
        moe.gather_rows(a, a, gf, None, *route, 0, 64, 64, 1, dg, db2.half())
