"""GPU tests of pitgen's torch.library ops (marker ``gpu``): ``torch.library.opcheck`` of every
op (schema, fake implementation, autograd registration, AOT dispatch), ``torch.compile``
(``fullgraph=True``: no graph break) of a small model of SparseLinear and MoE layers matching
eager in forward and backward, the JIT matmul and SDDMM compiled, and CUDA graph capture of a
compiled call replayed on new inputs."""
from __future__ import annotations

import importlib.util

import pytest

import pitgen
import pitgen.nn
from pitgen.ops import linear, sddmm as sd
from pitgen.ops.library import ops
from pitgen.ops.moe import route_tensors
from pitgen.testing import assert_close, poison

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="GPU tests need torch")

TOL = {"float16": 1e-2, "bfloat16": 2e-2, "float32": 5e-3}
BACKENDS = ["aot_eager", pytest.param("inductor", marks=pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="inductor needs triton"))]
#: outputs that hold undefined slots (past a device-side count): no run-to-run comparison
NO_COMPARE = ("test_schema", "test_autograd_registration", "test_faketensor")


def cuda(*shape, dtype=torch.float32, grad=False):
    return torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=grad)


def _cases():
    """(op name, args, test_utils or None for all) of every pitgen op."""
    f32 = torch.float32
    mask = torch.rand(96, 70, device="cuda") < 0.3
    wmask = (torch.rand(3, 40, device="cuda") < 0.3).repeat_interleave(32, 0)[:80]
    kern = pitgen.compile("C[m,n] += A[m,k] * B[k,n]", sparse="A", dtype="float32",
                          micro_tile=(32, 1))
    a = cuda(96, 70) * mask
    ids = torch.rand(37, 4, device="cuda").argsort(1)[:, :2].contiguous()
    return [
        ("matmul", (a, cuda(70, 24), mask, kern.config), None),
        ("gemm", (a, cuda(70, 24), mask, sd.GRAD_EXPR, "A", "auto"), None),
        ("sddmm", (cuda(96, 32, grad=True), cuda(70, 32, grad=True), mask, [32, 1], 0.5), None),
        ("sddmm_tiles", (cuda(96, 32), cuda(70, 32), mask, [1, 32], 1.0), NO_COMPARE),
        ("sddmm_out", (cuda(96, 32), cuda(70, 32), mask, [16, 16], 1.0,
                       torch.empty(96, 70, device="cuda")), None),
        ("sparse_weight_linear", (cuda(50, 40, grad=True), cuda(80, 40, grad=True), wmask,
                                  cuda(80, grad=True), "32x1", "dense", [32, 1]), None),
        ("sparse_weight_linear", (cuda(50, 40, grad=True), cuda(80, 40, grad=True), wmask, None,
                                  "32x1", "32x1", [32, 1]), None),
        ("sparse_input_linear", (torch.relu(cuda(64, 40)).requires_grad_(),
                                 cuda(24, 40, grad=True), cuda(24, grad=True), "auto"), None),
        ("moe_ffn", (cuda(37, 32, grad=True), ids, torch.rand(37, 2, device="cuda", dtype=f32,
                                                               requires_grad=True),
                     cuda(4, 32, 48, grad=True), cuda(4, 48, 32, grad=True),
                     cuda(4, 48, grad=True), cuda(4, 32, grad=True), "gelu"), None),
        ("moe_route", (ids, 4, 64), NO_COMPARE),
        ("moe_gather", (cuda(37, 32, dtype=torch.float16), cuda(37, 32, dtype=torch.float16),
                        torch.rand(74, device="cuda"), cuda(4, 32),
                        *(t.clone() for t in route_tensors(ids.int(), 4, 64)), 64, 128, 64, 2,
                        cuda(74), cuda(4, 32)),
         NO_COMPARE),   # the float32 sums it adds into dg and db2 land in any order
        ("moe_rows", (cuda(128, 32, dtype=torch.float16), cuda(4, 32, 48, dtype=torch.float16),
                      torch.tensor([2, 0], dtype=torch.int32, device="cuda"),
                      torch.tensor([2], dtype=torch.int32, device="cuda"), 0, 64, False,
                      cuda(4, 48)), None),
        ("moe_rows_act", (cuda(128, 32, dtype=torch.float16), cuda(4, 48, 32, dtype=torch.float16),
                          cuda(128, 48), torch.rand(128, device="cuda"),
                          torch.tensor([2, 0], dtype=torch.int32, device="cuda"),
                          torch.tensor([2], dtype=torch.int32, device="cuda"), 0, 64, "gelu",
                          torch.randperm(128, device="cuda").int(), cuda(130), cuda(4, 48)),
         NO_COMPARE),   # dg's and db1's float32 sums land in any order
    ]


def test_opcheck_every_op():
    pit = ops()
    seen = set()
    for name, args, utils in _cases():
        seen.add(name)
        kw = {} if utils is None else {"test_utils": utils}
        torch.library.opcheck(getattr(pit, name).default, args, **kw)
    assert seen == {"matmul", "gemm", "sddmm", "sddmm_tiles", "sddmm_out", "sparse_weight_linear",
                    "sparse_input_linear", "moe_ffn", "moe_route", "moe_gather", "moe_rows",
                    "moe_rows_act"}


class Block(torch.nn.Module):
    """A pruned SparseLinear, a ReLU, an MoE block and a sparse-input SparseLinear."""

    def __init__(self, dtype):
        super().__init__()
        kw = {"device": "cuda", "dtype": dtype}
        self.up = pitgen.nn.SparseLinear(64, 128, **kw)
        self.moe = pitgen.nn.MoE(128, 256, 4, topk=2, **kw)
        self.down = pitgen.nn.SparseLinear(128, 48, sparse_input=True, **kw)
        self.up.prune_(0.7, tile=(32, 1))

    def forward(self, x):
        h = torch.relu(self.up(x))
        return self.down(torch.relu(h + self.moe(h)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_compiled_model_matches_eager_forward_and_backward(backend, dtype):
    torch.manual_seed(0)
    model = Block(getattr(torch, dtype))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)  # a graph break fails
    x = torch.randn(3, 41, 64, device="cuda", dtype=getattr(torch, dtype))

    y = model(x)
    y.float().square().mean().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    got_y = compiled(x)
    got_y.float().square().mean().backward()
    assert got_y.shape == (3, 41, 48)
    assert_close(got_y, y.detach().double(), dtype, tol=TOL[dtype], what="y")
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert_close(p.grad, want[name].double(), dtype, tol=TOL[dtype], what=f"d{name}")


def test_compiled_model_has_no_graph_break():
    model = Block(torch.float16)
    x = torch.randn(40, 64, device="cuda", dtype=torch.float16)
    torch._dynamo.reset()
    with torch.no_grad():
        report = torch._dynamo.explain(model)(x)
    assert report.graph_break_count == 0, report.break_reasons
    assert report.graph_count == 1


def test_compiled_jit_matmul_and_sddmm():
    kern = pitgen.compile("C[m,n] += A[m,k] * B[k,n]", sparse="A", dtype="float16",
                          micro_tile=(32, 1))

    def f(a, b, q, k, mask):
        return kern(a, b) * 2, sd.sddmm(q, k, mask, tile=(1, 32), layout=torch.strided)

    mask = torch.rand(128, 90, device="cuda") < 0.2
    a = torch.randn(128, 90, device="cuda", dtype=torch.float16) * mask
    b = torch.randn(90, 56, device="cuda", dtype=torch.float16)
    q = torch.randn(128, 32, device="cuda", dtype=torch.float16)
    k = torch.randn(90, 32, device="cuda", dtype=torch.float16)
    torch._dynamo.reset()
    c, s = torch.compile(f, backend="aot_eager", fullgraph=True)(a, b, q, k, mask)
    assert_close(c, 2 * a.double() @ b.double(), "float16")
    assert_close(s, (q.double() @ k.double().t()) * mask, "float16")


def test_cuda_graph_of_a_compiled_call_replays_with_new_inputs():
    torch.manual_seed(1)
    model = Block(torch.float16).eval()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(96, 64, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            compiled(x)  # warm-up: compiles, plans, loads modules outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = compiled(x)
        for _ in range(3):
            x.copy_(torch.randn_like(x))
            model.up.prune_(0.5, tile=(32, 1))  # a new mask in place: the graph reads it
            poison(out)
            graph.replay()
            torch.cuda.synchronize()
            assert_close(out, model(x).double(), "float16", tol=TOL["float16"])


def test_training_step_under_compile_changes_the_weights():
    torch.manual_seed(2)
    model = Block(torch.float32)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _ in range(2):
        loss = compiled(torch.randn(33, 64, device="cuda")).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    for n, p in model.named_parameters():
        assert torch.isfinite(p).all(), n
        assert not torch.equal(p, before[n]), n
    # weight gradients never leave the mask: pruned weights stay where they were
    off = ~model.up.weight_mask
    assert torch.equal(model.up.weight[off], before["up.weight"][off])


def test_compiled_functional_linear_matches_eager():
    x = torch.relu(torch.randn(64, 40, device="cuda", dtype=torch.float16))
    w = torch.randn(24, 40, device="cuda", dtype=torch.float16)
    y = linear.sparse_input_linear(x, w)
    torch._dynamo.reset()
    yc = torch.compile(linear.sparse_input_linear, backend="aot_eager", fullgraph=True)(x, w)
    assert_close(yc, y.double(), "float16")
    assert_close(y, x.double() @ w.double().t(), "float16")


def test_block_with_sparse_attention_compiles_to_one_graph_and_matches_eager():
    """The benchmark's block (pitgen.bench.compiled: SparseAttention with a block-sparse mask,
    SparseLinear both ways, MoE) under fullgraph=True: one graph, and forward and gradients
    as eager's."""
    from pitgen.bench.compiled import _block, _mask
    torch.manual_seed(0)
    gen = torch.Generator(device="cuda").manual_seed(1)
    model = _block(128, 2, torch.bfloat16)
    mask = _mask(300, gen)
    x = torch.randn(2, 300, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    torch._dynamo.reset()
    with torch.no_grad():
        report = torch._dynamo.explain(model)(x, mask)
    assert report.graph_break_count == 0 and report.graph_count == 1, report.break_reasons
    y = model(x, mask)
    y.float().square().mean().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    got = torch.compile(model, fullgraph=True)(x, mask)
    got.float().square().mean().backward()
    assert_close(got, y.detach().double(), "bfloat16", tol=2e-2, what="y")
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert_close(p.grad, want[name].double(), "bfloat16", tol=5e-2, what=f"d{name}")


def test_clearing_the_caches_keeps_the_ops_registered():
    """pitgen.cache.clear() drops compiled modules, plans and launch closures, not the torch
    ops: attention traced afterwards is still one op in one graph (its op registering again
    during the trace was a graph break, and depended on which test cleared the caches first)."""
    from pitgen.ops.attention import sparse_attention
    ops()   # registered before the caches are cleared, whatever ran before
    q = torch.randn(1, 2, 96, 64, device="cuda", dtype=torch.float16)
    mask = torch.rand(96, 96, device="cuda") < 0.4
    want = sparse_attention(q, q, q, mask)
    pitgen.cache.clear()
    torch._dynamo.reset()
    fn = lambda x, m: sparse_attention(x, x, x, m) * 2  # noqa: E731
    report = torch._dynamo.explain(fn)(q, mask)
    assert report.graph_break_count == 0 and report.graph_count == 1, report.break_reasons
    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, mask)
    assert_close(got, 2 * want.double(), "float16")
