"""The lean launch path (issue 16): launches go straight onto torch's current stream through the
driver, and a repeated torch call finds its launcher from the tensors' raw attributes. Checked
here: reuse and its key (a new alignment or layout is a new launcher, never a stale one), stream
ordering with work queued just before on a side stream, and CUDA-graph capture and replay."""
import numpy as np
import pytest

from pitgen.testing import assert_close

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

import pitgen  # noqa: E402

EXPR = "C[m,n] += A[m,k] * B[k,n]"


def sparse_a(m: int, k: int, density: float, seed: int) -> "torch.Tensor":
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=g)
    return a * (torch.rand(m, k, device="cuda", generator=g) < density).half()


def reference(a, b):
    return a.double().cpu().numpy() @ b.double().cpu().numpy()


def poisoned(m: int, n: int):
    return torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)


def check(out, a, b):
    assert_close(out.double().cpu().numpy(), reference(a, b), "float16",
                 scale=np.abs(a.double().cpu().numpy()) @ np.abs(b.double().cpu().numpy()))


def test_a_repeated_call_reuses_its_launcher_and_a_new_layout_gets_its_own():
    kern = pitgen.compile(EXPR, sparse="A", dtype="float16", micro_tile="32x1")
    base = sparse_a(130, 200, 0.2, 0)
    b = torch.randn(200, 72, device="cuda", dtype=torch.float16)
    for seed in range(3):  # new values every call, one launcher
        a = sparse_a(130, 200, 0.2, seed)
        out = poisoned(130, 72)
        kern(a, b, out=out)
        check(out, a, b)
    assert len(kern._fast) == 1
    # a view 2 bytes off 16-byte alignment and a transposed layout: launchers of their own
    big = torch.zeros(130 * 200 + 1, device="cuda", dtype=torch.float16)
    shifted = big[1:].view(130, 200)
    shifted.copy_(base)
    check(kern(shifted, b), shifted, b)
    at = base.t().contiguous().t()
    check(kern(at, b), at, b)
    assert len(kern._fast) == 3
    # keyword operands take the full path and still agree
    check(kern(A=base, B=b), base, b)


def test_operands_written_just_before_on_a_side_stream_are_read_in_order():
    kern = pitgen.compile(EXPR, sparse="A", dtype="float16", micro_tile="32x1")
    a0 = sparse_a(256, 256, 0.1, 1)
    b = torch.randn(256, 128, device="cuda", dtype=torch.float16)
    kern(a0, b)  # plans and compiles
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(2_000_000)  # ~1 ms: the launch is queued long before a is written
        a = a0 * 2
        out = kern(a, b)
    torch.cuda.current_stream().wait_stream(s)
    check(out, a0 * 2, b)


def test_a_captured_call_replays_on_new_values():
    kern = pitgen.compile(EXPR, sparse="A", dtype="float16", micro_tile="32x1")
    a = sparse_a(192, 256, 0.15, 2)
    b = torch.randn(256, 64, device="cuda", dtype=torch.float16)
    out = poisoned(192, 64)
    kern(a, b, out=out)  # plan, compile and load outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kern(a, b, out=out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kern(a, b, out=out)
    for seed in (3, 4):
        a.copy_(sparse_a(192, 256, 0.15, seed))  # another sparsity pattern, same buffer
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(out, a, b)


def test_attention_checks_are_memoised_per_layout_and_still_refuse_bad_calls():
    from pitgen.ops import attention as A
    q, k, v = (torch.randn(1, 2, 130, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    mask = torch.rand(130, 130, device="cuda") < 0.3
    first = A.sparse_attention(q, k, v, mask)
    again = A.sparse_attention(q, k, v, mask)  # the memoised plan: same answer
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    assert A._CHECKED
    odd = torch.empty(q.numel() + 1, device="cuda", dtype=q.dtype)[1:].view(q.shape)
    odd.copy_(q)
    with pytest.raises(pitgen.ShapeError, match="q is not 16-byte aligned"):
        A.sparse_attention(odd, k, v, mask)
    with pytest.raises(pitgen.ShapeError, match="mask has dtype"):
        A.sparse_attention(q, k, v, mask.float())
    with pytest.raises(pitgen.ShapeError, match="k has dtype"):
        A.sparse_attention(q, k.bfloat16(), v, mask)


def test_moe_checks_are_memoised_per_layout_and_still_refuse_bad_calls():
    from pitgen.ops.moe import moe_ffn
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(70, 64, device="cuda", dtype=torch.float16, generator=g)
    w1 = torch.randn(4, 64, 128, device="cuda", dtype=torch.float16, generator=g) / 8
    w2 = torch.randn(4, 128, 64, device="cuda", dtype=torch.float16, generator=g) / 11
    ids = torch.randint(0, 4, (70, 1), device="cuda", dtype=torch.int32, generator=g)
    gates = torch.rand(70, 1, device="cuda", generator=g)
    first = moe_ffn(x, ids, gates, w1, w2, check=False)
    again = moe_ffn(x, ids, gates, w1, w2, check=False)  # memoised checks: same answer
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    with pytest.raises(pitgen.errors.PlanError, match="tanh"):
        moe_ffn(x, ids, gates, w1, w2, activation="tanh", check=False)
    with pytest.raises(pitgen.ShapeError, match="gates"):
        moe_ffn(x, ids, gates[:69], w1, w2, check=False)
    with pytest.raises(pitgen.ShapeError, match="expert_ids: 1 ids outside"):
        bad = ids.clone()
        bad[3] = 9
        moe_ffn(x, bad, gates, w1, w2)  # check=True still reads the verdict every call


def _moe_case(seed: int, T: int = 96):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, 64, device="cuda", dtype=torch.float16, generator=g)
    ids = torch.randint(0, 4, (T, 1), device="cuda", dtype=torch.int32, generator=g)
    gates = torch.rand(T, 1, device="cuda", generator=g)
    return x, ids, gates


def test_graphs_captured_on_one_stream_share_no_buffers():
    """Two graphs captured on torch's default capture stream, replayed at once on two streams:
    each gives its own answer (captured calls take fresh index buffers, scratch and counters,
    not the per-stream ones eager calls keep, which the two graphs would share)."""
    from pitgen.ops.attention import sparse_attention
    from pitgen.ops.moe import moe_ffn
    g = torch.Generator(device="cuda").manual_seed(7)
    w1 = torch.randn(4, 64, 128, device="cuda", dtype=torch.float16, generator=g) / 8
    w2 = torch.randn(4, 128, 64, device="cuda", dtype=torch.float16, generator=g) / 11
    kern = pitgen.compile(EXPR, sparse="A", dtype="float16", micro_tile="32x1")
    b = torch.randn(256, 64, device="cuda", dtype=torch.float16)
    qkv = [torch.randn(1, 2, 192, 64, device="cuda", dtype=torch.float16, generator=g)
           for _ in range(3)]

    def ops(case):
        a, (x, ids, gates), mask = case
        return (kern(a, b), moe_ffn(x, ids, gates, w1, w2, check=False),
                sparse_attention(*qkv, mask))

    cases = [(sparse_a(192, 256, d, s), _moe_case(s),
              torch.rand(192, 192, device="cuda", generator=g) < d)
             for d, s in ((0.1, 11), (0.6, 12))]
    for case in cases:   # plan, compile and load outside the captures
        ops(case)
    torch.cuda.synchronize()
    graphs, outs = [], []
    for case in cases:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs.append(ops(case))
        graphs.append(graph)
    want = [ops(case) for case in cases]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for _ in range(20):
        for out in outs:
            for o in out:
                o.fill_(float("nan"))
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())
        for graph, s in zip(graphs, streams):
            with torch.cuda.stream(s):
                graph.replay()
        for s in streams:
            torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        for got, exp in zip(outs, want):
            for o, w in zip(got, exp):
                torch.testing.assert_close(o, w, rtol=0, atol=0)


def test_threads_on_one_stream_keep_their_calls_apart():
    """Worker threads calling the matmul and the MoE layer on the same (default) stream, each
    with its own operands: every answer is its own (a call's launches over the per-stream
    buffers it reuses are enqueued under a lock)."""
    from concurrent.futures import ThreadPoolExecutor
    from pitgen.ops.moe import moe_ffn
    g = torch.Generator(device="cuda").manual_seed(8)
    w1 = torch.randn(4, 64, 128, device="cuda", dtype=torch.float16, generator=g) / 8
    w2 = torch.randn(4, 128, 64, device="cuda", dtype=torch.float16, generator=g) / 11
    kern = pitgen.compile(EXPR, sparse="A", dtype="float16", micro_tile="32x1")
    b = torch.randn(256, 64, device="cuda", dtype=torch.float16)
    cases = [(sparse_a(192, 256, 0.05 + 0.1 * s, 20 + s), _moe_case(20 + s)) for s in range(8)]
    want = [(kern(a, b), moe_ffn(x, ids, gates, w1, w2, check=False)) for a, (x, ids, gates)
            in cases]

    def work(case):
        a, (x, ids, gates) = case
        return [(kern(a, b), moe_ffn(x, ids, gates, w1, w2, check=False)) for _ in range(10)]

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(work, cases))
    torch.cuda.synchronize()
    for runs, exp in zip(got, want):
        for run in runs:
            for o, w in zip(run, exp):
                torch.testing.assert_close(o, w, rtol=0, atol=0)


def test_kept_buffers_stay_bounded_over_many_call_signatures():
    """Eager calls keep one scratch buffer per stream (at most KEPT_SCRATCH bytes) whatever the
    shapes seen, and a SparseKernel at most MAX_LAUNCHERS launchers with their index buffers."""
    from pitgen import runtime
    from pitgen.ops import matmul
    from pitgen.ops.attention import sparse_attention
    from pitgen.ops.moe import moe_ffn
    g = torch.Generator(device="cuda").manual_seed(9)
    w1 = torch.randn(4, 64, 128, device="cuda", dtype=torch.float16, generator=g) / 8
    w2 = torch.randn(4, 128, 64, device="cuda", dtype=torch.float16, generator=g) / 11
    for t in range(1, 40, 3):
        x, ids, gates = _moe_case(t, T=t)   # one plan per T, one kept scratch for all
        y = moe_ffn(x, ids, gates, w1, w2, check=False)
        assert_close(y.double().cpu().numpy(), _moe_reference(x, ids, gates, w1, w2),
                     "float16")
        q = torch.randn(1, 1, 16 * t, 64, device="cuda", dtype=torch.float16, generator=g)
        sparse_attention(q, q, q, torch.rand(16 * t, 16 * t, device="cuda", generator=g) < 0.5)
    stream = torch.cuda.current_stream().cuda_stream
    buf, _ = runtime._KEPT[(torch.cuda.current_device(), stream)]
    assert buf.numel() <= runtime.KEPT_SCRATCH
    kern = pitgen.compile(EXPR, sparse="A", dtype="float16", micro_tile="32x1")
    b = torch.randn(64, 8, device="cuda", dtype=torch.float16)
    for m in range(1, matmul.MAX_LAUNCHERS + 10):
        a = sparse_a(m, 64, 0.3, m)
        out = kern(a, b)
        if m % 16 == 0:
            check(out, a, b)
    assert len(kern._launchers) <= matmul.MAX_LAUNCHERS
    assert len(kern._fast) <= matmul.MAX_LAUNCHERS


def _moe_reference(x, ids, gates, w1, w2):
    from pitgen.reference import moe_reference
    f64 = lambda a: a.double().cpu().numpy()  # noqa: E731
    return moe_reference(f64(x), ids.cpu().numpy(), f64(gates), f64(w1), f64(w2))


def test_device_facts_are_the_current_devices_own():
    """device_arch and device_sms (asked once per device, then remembered) match what torch
    reports for every device, whichever was current first."""
    from pitgen import runtime
    for dev in reversed(range(torch.cuda.device_count())):
        with torch.cuda.device(dev):
            major, minor = torch.cuda.get_device_capability(dev)
            sms = torch.cuda.get_device_properties(dev).multi_processor_count
            for _ in range(2):   # the first call asks the driver, the second remembers
                assert runtime.device_arch() == f"sm_{major}{minor}"
                assert runtime.device_sms() == sms


@pytest.mark.parametrize("micro_tile,dtype", [("32x1", "float16"), ("64x1", "bfloat16"),
                                              ("32x64", "float16"), ("64x64", "float32")])
def test_small_problems_run_in_one_launch_and_agree_with_two(micro_tile, dtype, monkeypatch):
    """A problem whose index CTAs and tiles fit one wave runs the fused kernel (lower.fuse):
    back to back on new patterns (empty, full, random; odd extents) it gives what the two
    launches give, and the index alone (SparseKernel.index) still builds."""
    from pitgen import lower
    tdt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(31)
    M, K, N = 150, 136, 72
    b = torch.randn(K, N, device="cuda", dtype=tdt, generator=g)
    masks = [torch.zeros(M, K, device="cuda", dtype=torch.bool),
             torch.ones(M, K, device="cuda", dtype=torch.bool)]
    masks += [torch.rand(M, K, device="cuda", generator=g) < d for d in (0.02, 0.3, 0.02, 0.7)]
    fused = pitgen.compile(EXPR, sparse="A", dtype=dtype, micro_tile=micro_tile)
    monkeypatch.setattr(lower, "FUSED_MAX_CTAS", 0)
    two = pitgen.compile(EXPR, sparse="A", dtype=dtype, micro_tile=micro_tile)
    a0 = torch.randn(M, K, device="cuda", dtype=tdt, generator=g)
    two(a0, b)
    monkeypatch.undo()
    fused(a0, b)
    assert next(iter(fused._launchers.values())).fused_mod is not None
    assert next(iter(two._launchers.values())).fused_mod is None
    assert "pit_gemm_fused(" in fused.source(a0, b) and "pit_gemm_fused(" not in two.source(a0, b)
    for mask in masks * 3:
        a = a0 * mask
        got, want = fused(a, b), two(a, b)
        if micro_tile.endswith("x1"):   # listed blocks come in any order: sums may round apart
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        ref = a.double().cpu().numpy() @ b.double().cpu().numpy()
        assert_close(got.double().cpu().numpy(), ref, dtype if dtype != "float32" else "tf32",
                     scale=np.abs(a.double().cpu().numpy()) @ np.abs(b.double().cpu().numpy()))
    counts, ids = fused.index(a0 * masks[2], b)
    counts2, ids2 = two.index(a0 * masks[2], b)
    torch.testing.assert_close(counts.cpu(), counts2.cpu())
    for c, x, y in zip(counts.cpu().tolist(), ids.cpu(), ids2.cpu()):
        assert sorted(x[:c].tolist()) == sorted(y[:c].tolist())


@pytest.mark.parametrize("b,h,s,d,dtype,lead", [(1, 2, 130, 64, "float16", ()),
                                                (2, 2, 192, 128, "bfloat16", (2, 1)),
                                                (1, 3, 64, 64, "float16", (3,))])
def test_small_attention_runs_in_one_launch_and_agrees_with_two(b, h, s, d, dtype, lead,
                                                                monkeypatch):
    """A masked problem whose index and forward grids fit one wave runs the one-launch forward
    (a module of its own): on empty, full and random masks (byte masks at S = 130, 16-byte ones
    at 64 and 192), called back to back and with its log-sum-exp, it agrees with the reference
    and with the two launches."""
    from pitgen import lower
    from pitgen import reference as R
    from pitgen.ops import attention as A
    tdt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(41)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=tdt, generator=g) for _ in range(3))
    shape = (*lead, s, s)
    masks = [torch.zeros(shape, device="cuda", dtype=torch.bool),
             torch.ones(shape, device="cuda", dtype=torch.bool)]
    masks += [torch.rand(shape, device="cuda", generator=g) < p for p in (0.03, 0.5, 0.03)]

    def run():
        A._EAGER.clear()
        got = [A.sparse_attention(q, k, v, m, return_lse=True) for m in masks * 2]
        fused = [f.fused is not None for f in A._EAGER.values()]
        return got, fused

    one, fused = run()
    assert fused and all(fused)
    monkeypatch.setattr(lower, "FUSED_MAX_CTAS", 0)
    two, fused = run()
    assert fused and not any(fused)
    f64 = lambda x: x.double().cpu().numpy()  # noqa: E731
    for m, (out, lse), (out2, lse2) in zip(masks * 2, one, two):
        ref = R.attention_reference(f64(q), f64(k), f64(v), m.cpu().numpy())
        assert_close(f64(out), ref, dtype)
        torch.testing.assert_close(out, out2, rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(lse, lse2, rtol=1e-4, atol=1e-4)
