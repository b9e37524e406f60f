"""CPU tests of RGCN inference (pitgen.ops.rgcn): the rules both orders rely on, the cost
model's choice, the composed operands, and both orders' NumPy plan executor against the float64
reference on drawn relational graphs (empty relations, isolated nodes, hubs)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pitgen import PlanError, ShapeError
from pitgen import testing as T
from pitgen.graph.formats import Relational
from pitgen.graph.kernels import SPMM
from pitgen.ops import rgcn as R
from pitgen.reference import rgcn_reference, spmm_csr


def test_rules_both_orders_rely_on():
    assert R.RGCN.derive() == {"relation rows": ("i",), "relations and neighbours": ("r", "j")}


def test_both_orders_run_the_csr_spmm_body():
    """No new variant: the composed relations are plain CSR, run under RGCN's rules."""
    ctx = {"dtype": "float16", "fmt": "csr", "vec": 8, "threads": 256, "group": 8, "unroll": 2,
           "packs": 1}
    assert R.RGCN.source(ctx) == SPMM.source(ctx) and dict(R.RGCN.kernels) == dict(SPMM.kernels)


@settings(max_examples=25)
@given(T.relational_graphs(), st.integers(1, 5), st.integers(1, 5), st.integers(0, 2**32 - 1))
def test_both_orders_match_the_reference(graph, f_in, f_out, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((graph.shape[2], f_in))
    w = rng.standard_normal((graph.shape[0], f_in, f_out))
    want = rgcn_reference(graph, x, w)
    dense = np.einsum("rij,jg,rgf->if", graph.to_dense(), x, w)
    np.testing.assert_allclose(want, dense, atol=1e-10)
    for order in R.ORDERS:
        plan = R.plan_rgcn(graph.shape, graph.relation_nnz(), f_in, f_out, "float32", order)
        assert plan.order == order
        np.testing.assert_allclose(R.execute_rgcn(plan, graph, x, w), want, atol=1e-10)


@settings(max_examples=25)
@given(T.relational_graphs())
def test_composed_operands(graph):
    rels, rows, cols = graph.shape
    vals = graph.values()
    tf = R.compose(graph, "transform-first")
    sources = sorted({(r, c) for r, c in zip(graph.rel, graph.col)})
    assert tf.compact == len(sources) and tf.first.shape == (rows, tf.compact)
    assert list(tf.take) == [c for _, c in sources]          # relation-major, then column
    assert list(tf.ends) == list(np.cumsum(np.bincount([r for r, _ in sources],
                                                       minlength=rels)))
    # B holds every edge once, at (row, its source's compact row)
    b = tf.first.to_dense()
    for r, i, j, v in zip(graph.rel, graph.row, graph.col, vals):
        assert b[i, sources.index((r, j))] == v
    assert np.count_nonzero(b) == np.count_nonzero(vals)

    af = R.compose(graph, "aggregate-first")
    pairs = sorted({(r, i) for r, i in zip(graph.rel, graph.row)})
    assert af.compact == len(pairs) and list(af.take) == [i for _, i in pairs]
    c = af.first.to_dense()
    dense = graph.to_dense()
    for p, (r, i) in enumerate(pairs):
        assert np.array_equal(c[p], dense[r, i])               # the pair's row of A_r
    s = af.second.to_dense()
    assert np.array_equal(s, np.array([[float(i == pi) for _, pi in pairs]
                                       for i in range(rows)]).reshape(rows, len(pairs)))
    # S @ C sums the relations' rows: the union of all relations, with values added
    np.testing.assert_allclose(spmm_csr(af.second, c), dense.sum(0), atol=1e-12)


def test_cost_model_follows_the_feature_sizes():
    shape, nnz = (8, 5000, 5000), [4000] * 8
    assert R.plan_rgcn(shape, nnz, 16, 256).order == "aggregate-first"   # aggregate narrow X
    assert R.plan_rgcn(shape, nnz, 256, 16).order == "transform-first"   # transform first
    p = R.plan_rgcn(shape, nnz, 16, 256, order="transform-first")
    assert p.order == "transform-first" and p.costs["transform-first"] > p.costs["aggregate-first"]
    assert "* aggregate-first" in R.plan_rgcn(shape, nnz, 16, 256).table()
    exact = R.plan_rgcn(shape, nnz, 32, 32, sources=100, pairs=30000)
    assert exact.compact == {"transform-first": 100, "aggregate-first": 30000}
    assert exact.order == "transform-first"
    assert R.distinct_estimate(10, 0) == 0 and R.distinct_estimate(10, 3) <= 3
    assert 9 < R.distinct_estimate(10, 1000) <= 10


def test_plan_and_executor_errors():
    g = Relational((2, 3, 3), [0, 1], [0, 2], [1, 1])
    with pytest.raises(PlanError, match="unknown RGCN order"):
        R.plan_rgcn(g.shape, g.relation_nnz(), 4, 4, order="both")
    with pytest.raises(ShapeError, match="dtype bfloat16"):
        R.plan_rgcn(g.shape, g.relation_nnz(), 4, 4, dtype="bfloat16")
    with pytest.raises(ShapeError, match="relation_nnz needs 2"):
        R.plan_rgcn(g.shape, [1], 4, 4)
    with pytest.raises(ShapeError, match="f_out must be a positive integer"):
        R.plan_rgcn(g.shape, g.relation_nnz(), 4, 0)
    plan = R.plan_rgcn(g.shape, g.relation_nnz(), 4, 2)
    with pytest.raises(ShapeError, match="W must be"):
        R.execute_rgcn(plan, g, np.ones((3, 4)), np.ones((3, 4, 2)))
    with pytest.raises(ShapeError, match="plan for"):
        R.execute_rgcn(plan, g, np.ones((3, 4)), np.ones((2, 4, 3)))
    with pytest.raises(ShapeError, match="W must be"):
        rgcn_reference(g, np.ones((3, 4)), np.ones((2, 5, 2)))
