"""MoE's launch sequence (``pitgen.ops.moe._Launch``) on the CPU: a fake module records each
driver launch, so the kernels each path enqueues, their order and the buffers they pass one
another are checked without a GPU (the GPU tests check the numbers)."""
from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")

import pitgen.ops.moe as moe  # noqa: E402


class FakeModule:
    def __init__(self) -> None:
        self.calls: list = []

    def bind(self, name, grid, block, smem=0, early=False):
        return lambda stream, *args: self.calls.append((name, args))


class FakeLaunch(contextlib.nullcontext):
    stream = 7

    def __enter__(self):
        return self


@pytest.fixture
def fake(monkeypatch):
    mod = FakeModule()
    monkeypatch.setattr(type(moe.MOE), "module", lambda self, ctx: mod)
    monkeypatch.setattr(moe, "TorchLaunch", FakeLaunch)
    monkeypatch.setattr(moe, "device_sms", lambda: 132)
    monkeypatch.setattr(moe, "kept_scratch",
                        lambda s, n, dev: (torch.empty(n, dtype=torch.uint8), None))
    monkeypatch.setattr(moe, "stream_counters",
                        lambda by, s, n, dev: torch.zeros(n, dtype=torch.int32))
    monkeypatch.setattr(moe, "tensor_map", lambda ptr, *a: ("map", ptr))
    monkeypatch.setattr(moe, "memset_d32",
                        lambda ptr, v, n, s: mod.calls.append(("memset", (ptr, v, n))))
    return mod


def _call(fake, T, topk, arch, dtype=torch.float16):
    E, H, F = 4, 64, 128
    plan = moe.plan_moe(T, topk, E, H, F, str(dtype).split(".")[1], "gelu", "int32", arch)
    run = moe._Launch(plan)
    x = torch.randn(T, H).to(dtype)
    ids = torch.zeros(T, topk, dtype=torch.int32)
    gates = torch.ones(T, topk)
    w1, w2 = torch.zeros(E, H, F, dtype=dtype), torch.zeros(E, F, H, dtype=dtype)
    y = run(x, ids, gates, w1, w2, None, None)
    assert y.shape == (T, H)
    return plan, [name for name, _ in fake.calls], dict(fake.calls)


@pytest.mark.parametrize("topk", [1, 2])
def test_hopper_path_places_rows_then_gemms_read_them(fake, topk):
    plan, names, args = _call(fake, 300, topk, "sm_90")
    assert plan.mainloop == "wgmma"
    assert names == (["memset"] if topk > 1 else []) + [
        "moe_route", "moe_place_gather", "moe_gemm1_sm90", "moe_gemm2_sm90"] + (
        ["moe_finish"] if topk > 1 else [])
    xs = args["moe_place_gather"][9]
    assert args["moe_gemm1_sm90"][0] == ("map", xs)               # A of GEMM1: the copied rows
    inter = args["moe_gemm1_sm90"][3]
    assert args["moe_gemm2_sm90"][0] == ("map", inter)            # A of GEMM2: GEMM1's output
    if topk > 1:  # the fp32 sums: zeroed, added into, finished
        assert args["memset"][0] == args["moe_gemm2_sm90"][4] == args["moe_finish"][0]


def test_mma_sync_paths(fake):
    plan, names, args = _call(fake, 300, 1, "sm_80")
    assert plan.mainloop == "mma_sync"
    assert names == ["moe_route", "moe_place", "moe_gemm1", "moe_gemm2"]
    assert args["moe_gemm2"][0] == args["moe_gemm1"][3]           # GEMM1's output, GEMM2's A
    fake.calls.clear()
    _, names, args = _call(fake, 100, 2, "sm_90")                 # one routing block, top-2
    assert names == ["memset", "moe_gemm1_routed", "moe_gemm2", "moe_finish"]
    assert args["moe_gemm2"][0] == args["moe_gemm1_routed"][14]
    fake.calls.clear()
    plan, names, args = _call(fake, 200, 1, "sm_90")              # and top-1: one launch
    assert names == ["moe_small"]
    ids, E, max_tiles, tickets = args["moe_small"][:4]
    assert (E, max_tiles) == (plan.experts, plan.max_tiles)
    assert args["moe_small"][-3:] == (plan.tokens, plan.hidden, plan.ffn)
