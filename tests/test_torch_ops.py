"""CPU tests of pitgen's torch.library ops (skipped without torch): registration on first use
(importing pitgen imports no torch), the fake implementations' shapes, dtypes and strides under
FakeTensorMode, torch.compile tracing a SparseLinear + MoE model into one graph (forward and
backward, with fake tensors), the JIT kernel's op configuration, and the refusal of inputs
that require grad by ops without a backward."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import pitgen
from pitgen.errors import BackwardError, PitgenError
from pitgen.ops import library
from pitgen.ops.sddmm import sddmm

torch = pytest.importorskip("torch")
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

OPS = ("matmul", "gemm", "sddmm", "sddmm_tiles", "sddmm_out", "sparse_weight_linear",
       "sparse_input_linear", "moe_ffn", "moe_route")


def test_importing_pitgen_imports_no_torch():
    code = ("import sys, pitgen, pitgen.nn, pitgen.ops.library, pitgen.ops.linear, "
            "pitgen.ops.moe, pitgen.ops.sddmm; assert 'torch' not in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_every_op_is_registered_in_the_pitgen_namespace():
    pit = library.ops()
    for name in OPS:
        schema = getattr(pit, name).default._schema
        assert schema.name == f"pitgen::{name}"
    assert "Tensor(a!) out" in str(pit.sddmm_out.default._schema)  # declared as mutating


def test_fake_implementations_propagate_shapes_dtypes_and_strides():
    pit = library.ops()
    h, b16, i32 = torch.float16, torch.bfloat16, torch.int32
    with FakeTensorMode():
        q, k = torch.empty(100, 64, dtype=h), torch.empty(70, 64, dtype=h)
        mask = torch.empty(100, 70, dtype=torch.bool)
        s = pit.sddmm(q, k, mask, [32, 1], 0.5)
        assert s.shape == (100, 70) and s.dtype == h and s.is_contiguous()
        values, rows, cols, count = pit.sddmm_tiles(q, k, mask, [1, 32], 1.0)
        cap = 100 * 3  # 100 rows by ceil(70 / 32) column tiles
        assert values.shape == (cap, 1, 32) and values.dtype == h
        assert rows.shape == cols.shape == (cap,) and rows.dtype == i32 and count.shape == (1,)

        x, w = torch.empty(10, 64, dtype=b16), torch.empty(48, 64, dtype=b16)
        wm = torch.empty(48, 64, dtype=torch.bool)
        y = pit.sparse_weight_linear(x, w, wm, None, "32x1", "dense", [32, 1])
        assert y.shape == (10, 48) and y.dtype == b16 and y.stride() == (1, 10)  # yᵀ's view
        assert pit.sparse_input_linear(x, w, torch.empty(48, dtype=b16), "auto").shape == (10, 48)
        assert pit.gemm(x, w, None, "C[m,n] += A[m,k] * B[n,k]", "A", "auto").shape == (10, 48)
        kern = pitgen.compile("C[m,n] += A[m,k] * B[k,n]", sparse="A", dtype="bfloat16",
                              micro_tile=(32, 1))
        c = pit.matmul(w, x.t(), None, kern.config)
        assert c.shape == (48, 10) and c.dtype == b16

        ids, gates = torch.empty(10, 2, dtype=torch.int64), torch.empty(10, 2)
        w1, w2 = torch.empty(4, 64, 32, dtype=b16), torch.empty(4, 32, 64, dtype=b16)
        out = pit.moe_ffn(x, ids, gates, w1, w2, None, None, "gelu")
        assert out.shape == (10, 64) and out.dtype == b16
        row_pair, tile_e, tile_r, offsets, ntiles = pit.moe_route(ids, 4, 64)
        assert row_pair.shape == (20,) and tile_e.shape == tile_r.shape == (1 + 4,)
        assert offsets.shape == (5,) and ntiles.shape == (1,) and tile_e.dtype == i32


def test_jit_kernel_config_rebuilds_the_kernel():
    kern = pitgen.compile("C[m,n] += A[m,k] * B[k,n]", sparse="A", dtype=torch.float16,
                          micro_tile=[np.int64(32), 1], tile={"n": 64, "m": 128})
    again = library._jit_kernel(kern.config + " ")  # a config the process has not seen
    assert again.config == kern.config and again is not kern
    assert again.plan.choice == kern.plan.choice
    assert library._jit_kernel(kern.config + " ") is again  # built once per config


def test_ops_without_backward_name_themselves():
    a = torch.randn(64, 32, requires_grad=True)
    with pytest.raises(BackwardError, match="pitgen::thing has no backward"):
        library.no_backward("pitgen::thing", None, a)
    library.no_backward("pitgen::thing", a.detach())
    with torch.no_grad():
        library.no_backward("pitgen::thing", a)
    kern = pitgen.compile("C[m,n] += A[m,k] * B[k,n]", sparse="A", dtype="float32",
                          micro_tile=(32, 1))
    with pytest.raises(BackwardError, match="pitgen::matmul"):
        kern(a, torch.randn(32, 16))
    assert issubclass(BackwardError, PitgenError)


def test_torch_compile_traces_a_model_into_one_graph_forward_and_backward(monkeypatch):
    """SparseLinear, MoE and a differentiable SDDMM under torch.compile(fullgraph=True) on fake
    tensors: one graph, the pitgen ops in it, every gradient through the registered backwards
    (traced by AOTAutograd). The device check is lifted: fake tensors here live on the CPU."""
    import pitgen.nn
    import pitgen.operands

    monkeypatch.setattr(pitgen.operands, "check_device", lambda name, x: None)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = pitgen.nn.SparseLinear(64, 128)
            self.moe = pitgen.nn.MoE(128, 256, 4, topk=2)
            self.down = pitgen.nn.SparseLinear(128, 48, sparse_input=True)

        def forward(self, x, q, k, mask):
            h = torch.relu(self.up(x))
            s = sddmm(q, k, mask, tile=(1, 32), layout=torch.strided)
            return self.down(torch.relu(h + self.moe(h))), s

    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd
        keep = lambda g, _: make_boxed_func(g.forward)  # noqa: E731
        return aot_autograd(fw_compiler=keep, bw_compiler=keep)(gm, inputs)

    model = Block()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        x = mode.from_tensor(torch.randn(3, 7, 64))
        q = mode.from_tensor(torch.randn(57, 32)).requires_grad_()
        k = mode.from_tensor(torch.randn(40, 32)).requires_grad_()
        mask = mode.from_tensor(torch.rand(57, 40) < 0.3)
        out, s = compiled(x, q, k, mask)
        assert out.shape == (3, 7, 48) and s.shape == (57, 40)
        (out.square().mean() + s.sum()).backward()
        assert q.grad.shape == q.shape and k.grad.shape == k.shape
    assert len(graphs) == 1
    code = graphs[0].code
    for op in ("sparse_weight_linear", "moe_ffn", "sparse_input_linear", "sddmm"):
        assert f"torch.ops.pitgen.{op}" in code
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, name
    torch._dynamo.reset()


class _ReferenceRoute:
    """``ops()`` stand-in whose ``moe_route`` is the NumPy routing reference, laid out as the
    GPU's buffers (tile list padded to its upper bound with garbage past ``ntiles``, row_pair
    -1 past the routed rows)."""

    @staticmethod
    def moe_route(expert_ids, experts, bm):
        from pitgen.reference import route_reference
        r = route_reference(expert_ids.numpy(), experts, bm)
        pairs = expert_ids.numel()
        tiles = -(-pairs // bm) + experts
        i32 = lambda a: torch.tensor(np.asarray(a), dtype=torch.int32)  # noqa: E731
        row_pair = torch.full((max(pairs, 1),), -1, dtype=torch.int32)
        row_pair[:len(r.row_pair)] = i32(r.row_pair)
        tile_e = torch.full((tiles,), 12345, dtype=torch.int32)  # past ntiles: undefined
        tile_r = torch.full((tiles,), -777, dtype=torch.int32)
        tile_e[:len(r.tile_e)] = i32(r.tile_e)
        tile_r[:len(r.tile_r)] = i32(r.tile_r)
        return row_pair, tile_e, tile_r, i32(r.offsets), i32([len(r.tile_e)])


@pytest.mark.parametrize("activation", ["gelu", "silu", "relu", "identity"])
@pytest.mark.parametrize("T,topk,E,chunk_bytes", [(37, 2, 4, 256 << 20), (130, 2, 8, 1),
                                                  (1, 1, 3, 256 << 20), (70, 1, 5, 1)])
def test_moe_backward_math_matches_float64_autograd(monkeypatch, activation, T, topk, E,
                                                    chunk_bytes):
    """moe_backward's tile walk (every chunk size, ids out of range skipped, empty experts) on
    the CPU over the reference routing, against float64 autograd of the layer."""
    from pitgen.ops import moe

    monkeypatch.setattr(moe, "ops", lambda: _ReferenceRoute)
    monkeypatch.setattr(moe, "BACKWARD_CHUNK_BYTES", chunk_bytes)
    g = torch.Generator().manual_seed(T * 7 + E)
    H, F = 24, 40
    x = torch.randn(T, H, generator=g)
    w1, w2 = torch.randn(E, H, F, generator=g) / 5, torch.randn(E, F, H, generator=g) / 6
    b1, b2 = torch.randn(E, F, generator=g), torch.randn(E, H, generator=g)
    gates = torch.rand(T, topk, generator=g) + 0.1
    ids = torch.randint(0, E - 1, (T, topk), generator=g)  # expert E-1 stays empty
    ids[0, 0] = E + 3 if T > 1 else ids[0, 0]  # out of range: skipped, no gradient
    dy = torch.randn(T, H, generator=g)
    got = moe.moe_backward(x, ids, gates, w1, w2, b1, b2, activation, dy)

    leaves = [t.double().requires_grad_() for t in (x, gates, w1, w2, b1, b2)]
    x64, g64, w164, w264, b164, b264 = leaves
    y = torch.zeros_like(x64)
    for e in range(E):
        ge = (g64 * (ids == e).double()).sum(1, keepdim=True)
        y = y + ge * (moe._act(activation, x64 @ w164[e] + b164[e]) @ w264[e] + b264[e])
    y.backward(dy.double())
    for name, mine, ref in zip(("dx", "dgates", "dw1", "dw2", "db1", "db2"), got, leaves):
        assert mine.dtype == torch.float32 and mine.shape == ref.shape, name
        torch.testing.assert_close(mine.double(), ref.grad, rtol=1e-4, atol=1e-4, msg=name)
    assert torch.count_nonzero(got[2][E - 1]) == 0 and torch.count_nonzero(got[4][E - 1]) == 0


def test_device_guard_runs_a_call_on_its_first_operands_device(monkeypatch):
    """operands.on_operand_device with fake tensors: a switch (torch.cuda.device) only when the
    first argument that has a device is a CUDA one other than the current; back after the call,
    also when it raises; nothing while torch traces."""
    from pitgen import operands

    class Fake:   # a tensor on device d (-1: the CPU)
        def __init__(self, d):
            self.d = d

        def get_device(self):
            return self.d

    class Graph:  # a DeviceCSR-like object: its tensors' device
        device = torch.device("cuda", 1)

    events, compiling = [], [False]

    class Switch:
        def __init__(self, d):
            self.d = d

        def __enter__(self):
            events.append(("to", self.d))

        def __exit__(self, *exc):
            events.append(("back", self.d))

    monkeypatch.setattr(torch.cuda, "device", Switch)
    monkeypatch.setattr(operands, "_PLAIN", [Fake, lambda: 0, lambda: compiling[0], torch.device])

    @operands.on_operand_device
    def op(*args, **kwargs):
        """An operator."""
        events.append("ran")
        if kwargs.get("fail"):
            raise pitgen.ShapeError("bad")
        return len(args)

    assert op.__doc__ == "An operator."
    cases = [((Fake(0), Fake(1)), {}, ["ran"]),                      # current device: no switch
             ((Fake(1), Fake(0)), {}, [("to", 1), "ran", ("back", 1)]),
             (("config", 3, Graph(), Fake(0)), {}, [("to", 1), "ran", ("back", 1)]),
             ((Fake(-1),), {}, ["ran"]),                             # a CPU tensor: validation's
             ((), {"x": Fake(2)}, [("to", 2), "ran", ("back", 2)]),   # keyword operands
             (("no operands",), {}, ["ran"])]
    for args, kwargs, want in cases:
        events.clear()
        assert op(*args, **kwargs) == len(args)
        assert events == want, (args, kwargs)
    events.clear()
    with pytest.raises(pitgen.ShapeError):
        op(Fake(1), fail=True)
    assert events == [("to", 1), "ran", ("back", 1)]
    compiling[0] = True            # torch traces: the op's body runs with the device as it is
    events.clear()
    op(Fake(1))
    assert events == ["ran"]
