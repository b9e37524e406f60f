"""GPU tests: operators run from threads other than the one that imported PyCUDA (autograd's
backward thread, a server's worker pool), compiling and loading their modules there, with the
same results as in the main thread, and each thread's PyCUDA context stack left as it was found
(PyCUDA aborts the whole process when a thread ends with a context pushed)."""
from __future__ import annotations

import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from pitgen import testing as T
import pitgen
from pitgen.ops import attention as A
from pitgen import runtime
from pitgen.graph.device import DeviceCSR
from pitgen.graph.kernels import spmm
from pitgen.ops.moe import moe_ffn
from pitgen.ops.sddmm import sddmm

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="GPU tests need torch")


def checked(fn):
    """fn(), then a check that this thread's PyCUDA context stack is as it was (empty)."""
    import pycuda.driver as drv
    value = fn()
    torch.cuda.synchronize()
    assert drv.Context.get_current() is None, "a PyCUDA context was left pushed"
    return value


def in_thread(fn):
    """checked(fn) in a new thread that then ends; its result, or its exception."""
    box = {}

    def body():
        try:
            box["value"] = checked(fn)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            box["error"] = e

    t = threading.Thread(target=body)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


@pytest.fixture
def cold():
    """PyCUDA imported by this thread first (as an application does), then no module loaded:
    the threads below load every module they launch."""
    runtime._drv()
    pitgen.cache.clear()


def test_every_operator_runs_and_loads_in_another_thread(cold):
    g = torch.Generator(device="cuda").manual_seed(0)
    rng = np.random.default_rng(0)

    def randn(*shape, dtype=torch.float16):
        return torch.randn(*shape, device="cuda", generator=g).to(dtype)

    q, k, v = (randn(1, 2, 130, 64) for _ in range(3))
    mask = torch.from_numpy(T.tile_mask(rng, 130, 130, (16, 16), 0.4)).cuda()
    got = in_thread(lambda: A.sparse_attention(q, k, v, mask))
    assert torch.equal(got, A.sparse_attention(q, k, v, mask))

    a = randn(96, 160) * (torch.rand(96, 160, device="cuda", generator=g) < 0.3)
    b = randn(160, 72)
    got = in_thread(lambda: pitgen.compile("C[m,n] += A[m,k] * B[k,n]", sparse="A",
                                           micro_tile="32x1", vendor_dense=False)(A=a, B=b))
    T.assert_close(got, a.double() @ b.double(), "float16", scale=T.term_scale(np.matmul, a, b))

    x = randn(64, 64)
    ids = torch.randint(0, 4, (64, 2), device="cuda", generator=g, dtype=torch.int32)
    gates = torch.rand(64, 2, device="cuda", generator=g)
    w1, w2 = randn(4, 64, 96) / 8, randn(4, 96, 64) / 8
    got = in_thread(lambda: moe_ffn(x, ids, gates, w1, w2))
    assert torch.equal(got, moe_ffn(x, ids, gates, w1, w2))

    smask = torch.rand(128, 96, device="cuda", generator=g) < 0.1
    qs, ks = randn(128, 64), randn(96, 64)
    got = in_thread(lambda: sddmm(qs, ks, smask).to_dense())
    assert torch.equal(got, sddmm(qs, ks, smask).to_dense())

    dense = (randn(200, 150, dtype=torch.float32)
             * (torch.rand(200, 150, device="cuda", generator=g) < 0.05))
    feats = randn(150, 32, dtype=torch.float32)
    got = in_thread(lambda: spmm(DeviceCSR.from_dense(dense), feats))
    T.assert_close(got, dense.double() @ feats.double(), "float32",
                   scale=T.term_scale(np.matmul, dense, feats))


def test_a_worker_pool_shares_the_operators():
    rng = np.random.default_rng(1)
    q, k, v = (torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    masks = [torch.from_numpy(T.tile_mask(rng, 256, 256, (64, 64), d)).cuda()
             for d in (0.1, 0.3, 0.5, 0.7, 0.9, 1.0, 0.2, 0.6)]
    want = [A.sparse_attention(q, k, v, m) for m in masks]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda m: checked(lambda: A.sparse_attention(q, k, v, m)), masks))
    for g, w in zip(got, want):
        assert torch.equal(g, w)


FIRST_USE_IN_A_WORKER = """
import threading, torch
from pitgen.ops import attention as A
q = torch.randn(1, 1, 64, 64, device="cuda", dtype=torch.float16)
m = torch.ones(64, 64, dtype=torch.bool, device="cuda")
out = {}
t = threading.Thread(target=lambda: out.setdefault("y", A.sparse_attention(q, q, q, m)))
t.start(); t.join()                       # the worker has ended: nothing may be left pushed
y = A.sparse_attention(q, q, q, m)        # then the main thread, as usual
torch.cuda.synchronize()
assert torch.equal(out["y"], y)
print("done")
"""


def test_first_use_in_a_worker_thread_leaves_nothing_pushed():
    """A process whose first pitgen call comes from a worker thread: PyCUDA must not be left
    with a context on that thread's stack (it would abort the process when the thread ends)."""
    r = subprocess.run([sys.executable, "-c", FIRST_USE_IN_A_WORKER], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "done", r.stderr[-2000:]
    assert "PyCUDA ERROR" not in r.stderr
