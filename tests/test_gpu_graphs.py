"""GPU tests: the dynamic paths (index build → compute, no host sync) captured in a CUDA graph
and replayed with new mask / routing contents in the same buffers, as torch.compile's
"reduce-overhead" mode or a serving loop does; each replay must match the float64 reference of
its own contents."""
from __future__ import annotations

import numpy as np
import pytest

from pitgen import testing as T
from pitgen import reference as R
import pitgen
from pitgen.ops import attention as A
from pitgen.ops.moe import moe_ffn
from pitgen.reference import moe_reference

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="GPU tests need torch")


def capture(fn):
    """fn() warmed up on a side stream, then captured; returns (graph, its static output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def test_attention_graph_replays_with_new_masks():
    rng = np.random.default_rng(0)
    q, k, v = (torch.randn(1, 2, 320, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    mask = torch.zeros(320, 320, dtype=torch.bool, device="cuda")
    graph, out = capture(lambda: A.sparse_attention(q, k, v, mask))
    qd, kd, vd = (x.double().cpu().numpy() for x in (q, k, v))
    for tile, density in (((64, 64), 0.3), ((1, 64), 0.2), ((16, 16), 0.6), ((64, 64), 0.0)):
        m = T.tile_mask(rng, 320, 320, tile, density)
        mask.copy_(torch.from_numpy(m))
        T.poison(out)
        graph.replay()
        T.assert_close(out, R.attention_reference(qd, kd, vd, m), "float16",
                       scale=T.attention_term_scale(qd, kd, vd, m), roundings=1)  # P in fp16


def test_moe_graph_replays_with_new_routing():
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens, H, F, E = 96, 64, 128, 6
    x = torch.randn(tokens, H, device="cuda", generator=g).half()
    w1 = (torch.randn(E, H, F, device="cuda", generator=g) / 8).half()
    w2 = (torch.randn(E, F, H, device="cuda", generator=g) / 8).half()
    ids = torch.zeros(tokens, 2, dtype=torch.int32, device="cuda")
    gates = torch.zeros(tokens, 2, device="cuda")
    graph, out = capture(lambda: moe_ffn(x, ids, gates, w1, w2, check=False))
    for skew in (1.0, 0.0):   # uniform routing, then every token on expert 0
        ids.copy_((torch.randint(0, E, (tokens, 2), device="cuda", generator=g) * skew).int())
        gates.copy_(torch.rand(tokens, 2, device="cuda", generator=g))
        graph.replay()
        args = [t.cpu().numpy() for t in (x, ids, gates, w1, w2)]
        T.assert_close(out, moe_reference(*args), "float16", scale=T.moe_term_scale(*args),
                       roundings=1)   # the activations stored in float16


def test_jit_matmul_graph_replays_with_new_sparsity():
    g = torch.Generator(device="cuda").manual_seed(0)
    kern = pitgen.compile("C[m,n] += A[m,k] * B[k,n]", sparse="A", micro_tile="32x1",
                          vendor_dense=False)
    a = torch.zeros(256, 192, device="cuda", dtype=torch.float16)
    b = torch.randn(192, 128, device="cuda", generator=g).half()
    graph, out = capture(lambda: kern(A=a, B=b))
    for density in (0.1, 0.5, 0.0):
        keep = torch.rand(256, 192, device="cuda", generator=g) < density
        a.copy_(torch.randn(256, 192, device="cuda", generator=g).half() * keep)
        graph.replay()
        T.assert_close(out, a.double().cpu().numpy() @ b.double().cpu().numpy(), "float16",
                       scale=T.term_scale(np.matmul, a, b))
