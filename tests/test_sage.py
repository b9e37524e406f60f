"""CPU tests of GraphSAGE training (pitgen.ops.sage, pitgen.bench.sage): importing needs no
torch; the transpose's rules, template and nvcc compiles; the custom operators' fake (meta)
kernels and autograd wiring; the float64 SAGEConv reference; SAGEConv's parameters (PyG's
names) and its validation; the benchmark's FLOP count, report and registration."""
from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pitgen import PlanError, ShapeError, compiler
from pitgen import testing as T
from pitgen.graph.device import TRANSPOSE, TRANSPOSE_EXPR
from pitgen.ops import sage as S

ROOT = Path(__file__).resolve().parents[1]


def test_importing_needs_no_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import pitgen.ops.sage as s, pitgen.bench.sage as b, pitgen.nn as nn\n"
            "assert 'SAGEConv' in nn.__all__ and 'GraphSAGE' in nn.__all__\n"
            "try:\n    s.SAGEConv\nexcept ImportError:\n    print('lazy')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "lazy"


def test_transpose_rules_and_template():
    """Aᵀ is read by dX[j,f] += A[i,j] dY[i,f]: j spatial (transposed rows written in any
    order, each slot to its own place)."""
    assert TRANSPOSE.derive() == {"transposed rows": ("j",)}
    assert TRANSPOSE_EXPR == "DX[j,f] += A[i,j] * DY[i,f]"
    src = TRANSPOSE.source({})
    assert src == TRANSPOSE.source({})
    for k in TRANSPOSE.kernels:
        assert f"void {k}(" in src
    assert src.count("atomicAdd(") == 1   # the counts; slots come from the sorted order


def nvcc_jobs(pool) -> list[Future]:
    """The transpose module for sm_80 and sm_90 (it has no dtype: two compiles)."""
    return [pool.submit(compiler.compile_source, TRANSPOSE.source({}), arch)
            for arch in ("sm_80", "sm_90")]


@pytest.mark.nvcc
def test_transpose_compiles_for_sm80_and_sm90(nvcc):
    assert all(len(job.result()) > 1000 for job in nvcc_jobs(nvcc))


def dense_reference(indptr, indices, x, w_l, w_r, b, aggr):
    n = len(indptr) - 1
    a = np.zeros((n, n))
    for i in range(n):
        for j in indices[indptr[i]:indptr[i + 1]]:
            a[i, j] += 1.0
    if aggr == "mean":
        a /= np.maximum(a.sum(1, keepdims=True), 1)
    y = a @ x @ w_l.T
    return y + (0 if w_r is None else x @ w_r.T) + (0 if b is None else b)


@settings(max_examples=30, deadline=None)
@given(T.csr_matrices(max_rows=30, max_cols=30), st.sampled_from(S.AGGREGATORS),
       st.booleans(), st.integers(1, 6), st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_sage_reference_matches_dense(csr, aggr, root, f_in, f_out, seed):
    """Isolated nodes (empty rows) aggregate to zero; the mean divides by the row length."""
    rng = np.random.default_rng(seed)
    n = csr.shape[0]
    keep = csr.indices < n
    counts = np.bincount(csr.row_ids()[keep], minlength=n)
    indptr, indices = np.concatenate([[0], np.cumsum(counts)]), csr.indices[keep]
    x = rng.standard_normal((n, f_in))
    w_l, w_r = rng.standard_normal((f_out, f_in)), rng.standard_normal((f_out, f_in))
    b = rng.standard_normal(f_out)
    got = S.sage_reference(indptr, indices, x, w_l, w_r if root else None, b, aggr)
    want = dense_reference(indptr, indices, x, w_l, w_r if root else None, b, aggr)
    np.testing.assert_allclose(got, want, atol=1e-12)


def test_unknown_aggregator_and_graph():
    with pytest.raises(PlanError, match="unknown aggregator 'max'"):
        S.sage_reference([0], [], np.zeros((0, 1)), np.zeros((1, 1)), None, None, "max")
    with pytest.raises(ShapeError, match="graph must be a pitgen DeviceCSR"):
        S.graph_spmm(np.eye(3), np.eye(3))
    with pytest.raises(ShapeError, match="graph must be a pitgen DeviceCSR"):
        S.aggregation_values("cora", "mean", "float32")


# -- torch on the CPU --------------------------------------------------------------------------

def _meta_graph(torch, rows: int, cols: int, nnz: int) -> tuple:
    i = lambda n: torch.empty(n, dtype=torch.int32, device="meta")   # noqa: E731
    return (i(rows + 1), i(nnz), i(nnz), i(cols + 1), i(nnz), i(nnz), i(nnz), i(nnz))


def test_operators_fake_kernels_and_autograd_on_meta():
    """The operators' shapes without a GPU (meta tensors run the fake kernels), and the
    autograd wiring: dX by the operator on Aᵀ ([cols, F]), edge values by SDDMM ([nnz]),
    gradients of gradients through the same operator."""
    torch = pytest.importorskip("torch")
    S._ops()
    assert S._ops() is S._ops()   # registered once
    x = torch.empty(5, 3, device="meta", requires_grad=True)
    v = torch.empty(7, device="meta", requires_grad=True)
    y = torch.ops.pitgen.graph_spmm(x, v, *_meta_graph(torch, 4, 5, 7), 0)
    assert y.shape == (4, 3) and y.requires_grad
    y.backward(torch.empty_like(y))
    assert x.grad.shape == (5, 3) and v.grad.shape == (7,)
    e = torch.ops.pitgen.graph_sddmm(torch.empty(4, 3, device="meta"),
                                     torch.empty(5, 3, device="meta"),
                                     *_meta_graph(torch, 4, 5, 7)[:3])
    assert e.shape == (7,)
    x2 = torch.empty(5, 3, device="meta", requires_grad=True)
    dy = torch.empty(4, 3, device="meta", requires_grad=True)
    y = torch.ops.pitgen.graph_spmm(x2, v.detach(), *_meta_graph(torch, 4, 5, 7), 3)
    (dx,) = torch.autograd.grad(y, x2, dy, create_graph=True)
    assert dx.shape == (5, 3) and dx.requires_grad   # a function of dy: second order works
    (ddy,) = torch.autograd.grad(dx, dy, torch.empty_like(dx))
    assert ddy.shape == (4, 3)


def test_sageconv_parameters_are_pygs():
    torch = pytest.importorskip("torch")
    from pitgen.nn import GraphSAGE, SAGEConv

    conv = SAGEConv(6, 4)
    assert list(conv.state_dict()) == ["lin_l.weight", "lin_l.bias", "lin_r.weight"]
    assert conv.lin_l.weight.shape == (4, 6) and conv.aggr == "mean"
    assert list(SAGEConv(6, 4, "sum", root_weight=False, bias=False).state_dict()) == \
        ["lin_l.weight"]
    half = SAGEConv(3, 2, dtype=torch.float16)
    assert half.lin_r.weight.dtype == torch.float16
    model = GraphSAGE(8, 16, 3, layers=3, aggr="sum")
    assert [(c.in_channels, c.out_channels, c.aggr) for c in model.convs] == \
        [(8, 16, "sum"), (16, 16, "sum"), (16, 3, "sum")]
    assert "aggr='mean'" in repr(conv)


def test_sageconv_validation():
    torch = pytest.importorskip("torch")
    from pitgen.nn import GraphSAGE, SAGEConv

    with pytest.raises(ShapeError, match="in_channels must be a positive integer"):
        SAGEConv(0, 4)
    with pytest.raises(ShapeError, match="out_channels must be a positive integer"):
        SAGEConv(4, True)
    with pytest.raises(PlanError, match="unknown aggregator 'lstm'"):
        SAGEConv(4, 4, "lstm")
    with pytest.raises(ShapeError, match="layers must be a positive integer"):
        GraphSAGE(4, 4, 4, layers=0)
    with pytest.raises(PlanError, match="unknown format 'coo'"):
        GraphSAGE(4, 4, 4, format="coo")
    assert SAGEConv(4, 4, format="hyb").format == "hyb" and SAGEConv(4, 4).format == "auto"
    with pytest.raises(ShapeError, match=r"x must be \[nodes, 4\], got \(3, 5\)"):
        SAGEConv(4, 2)(None, torch.zeros(3, 5))
    with pytest.raises(ShapeError, match="graph must be a pitgen DeviceCSR"):
        SAGEConv(4, 2)("not a graph", torch.zeros(3, 4))


def test_sageconv_order_of_operations_with_another_aggregation():
    """The layer on any aggregation (the benchmark's peers override ``propagate``): weight
    first when in > out, the same result as aggregating first (float64, a dense A)."""
    torch = pytest.importorskip("torch")
    from pitgen.ops.sage import _build_module_classes

    base = _build_module_classes()["SAGEConv"]

    class Dense(base):
        def propagate(self, graph, x):
            return graph @ x

    rng = np.random.default_rng(0)
    a = torch.from_numpy((rng.random((9, 9)) < 0.3).astype(np.float64))
    for f_in, f_out in ((7, 3), (3, 7)):
        conv = Dense(f_in, f_out, dtype=torch.float64)
        x = torch.from_numpy(rng.standard_normal((9, f_in)))
        p = {k: v.detach().numpy() for k, v in conv.named_parameters()}
        want = a.numpy() @ x.numpy() @ p["lin_l.weight"].T + p["lin_l.bias"] + \
            x.numpy() @ p["lin_r.weight"].T
        np.testing.assert_allclose(conv(a, x).detach().numpy(), want, atol=1e-12)


# -- the benchmark's CPU side ------------------------------------------------------------------

def test_bench_flop_and_registration():
    from pitgen.bench import sage, suite

    assert "sage" in suite.PARTS and "sage.md" in suite.PARTS["sage"]
    args = suite.parser().parse_args(["sage", "--quick"])
    suite._check(suite.parser(), args)
    assert args.parts == ["sage"]
    # 2 layers 8 -> 8 -> 2 over 10 nodes, 30 edges: the first layer's SpMM runs forward only
    want = (3 * 2 * 2 * 10 * 8 * 8 + 1 * 2 * 30 * 8) + (3 * 2 * 2 * 10 * 8 * 2 + 2 * 2 * 30 * 2)
    assert sage.flop(10, 30, 8, 2, 2) == want


def test_bench_report(tmp_path):
    from pitgen.bench import sage

    ok = {"gpu_ms": 1.0, "wall_ms": 1.5, "losses": [2.8, 2.7, 2.6, 2.5, 2.4], "loss_err": 1e-6,
          "ok": True}
    row = {"graph": "cora", "nodes": 2708, "edges": 10556, "dtype": "float16", "feat": 128,
           "layers": 2, "classes": 16, "flop": 1, "prep_ms": {"pitgen": 0.5, "pitgen hyb": 9.0},
           "ref_loss": 2.8, "ok": True, "best_peer_ms": 2.0, "speedup": 2.0,
           "wall_speedup": 1.0,
           "systems": {"pitgen": ok, "pitgen hyb": {**ok, "gpu_ms": 0.9},
                       "pitgen unfused": {**ok, "gpu_ms": 1.6},
                       "torch.sparse.mm": {**ok, "gpu_ms": 2.0},
                       "cuSPARSE cached Aᵀ": {"note": "not run: half refused"}}}
    bad = {**row, "graph": "reddit", "speedup": 0.5, "ok": False,
           "systems": {**row["systems"], "pitgen": {**ok, "ok": False}}}
    meta = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11", "cuda": "13.0", "date": "now",
            "repeats": 10}
    sage.write(tmp_path, [row, bad], meta)
    md = (tmp_path / "sage.md").read_text()
    assert "| float16 | 2 | 1.00x | 1.00x | >= 1.5x | **missed** | NO |" in md
    assert "not run: half refused" in md and "**WRONG**" in md
    assert "| 2.00x | 1.25x | 2.800 -> 2.400 | 0.50 | 9.00 |" in md   # unfused: 2.0 / 1.6
    assert "pitgen hyb ms (wall)" in md and "pitgen unfused ms (wall)" in md
    doc = json.loads((tmp_path / "sage.json").read_text())
    assert doc["summary"][0]["all_correct"] is False and len(doc["rows"]) == 2
