"""CPU tests of RGCN inference (pitgen.ops.rgcn): the rules both orders rely on, the cost
model's choice (against the H100 measurement of the bench graphs), the composed operands (tiles,
pieces), and both orders' NumPy plan executor against the float64 reference on drawn relational
graphs (empty relations, isolated nodes, hubs)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pitgen import PlanError, ShapeError
from pitgen import testing as T
from pitgen.graph.formats import Relational
from pitgen.graph.kernels import SPMM
from pitgen.graphs import RGCN_GRAPHS, make_relational
from pitgen.ops import rgcn as R
from pitgen.reference import rgcn_reference, spmm_csr


def test_rules_both_orders_rely_on():
    assert R.RGCN.derive() == {"relation rows": ("i",), "relations and neighbours": ("r", "j")}


def test_both_orders_run_the_csr_spmm_body():
    """No new variant: the composed relations are plain CSR, run under RGCN's rules."""
    ctx = {"dtype": "float16", "fmt": "csr", "vec": 8, "threads": 256, "group": 8, "unroll": 2,
           "packs": 1}
    assert R.RGCN.source(ctx) == SPMM.source(ctx) and dict(R.RGCN.kernels) == dict(SPMM.kernels)


PIECES = st.sampled_from([None, 0, 1, 2, 3])


@settings(max_examples=25)
@given(T.relational_graphs(), st.integers(1, 5), st.integers(1, 5), PIECES,
       st.integers(0, 2**32 - 1))
def test_both_orders_match_the_reference(graph, f_in, f_out, piece, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((graph.shape[2], f_in))
    w = rng.standard_normal((graph.shape[0], f_in, f_out))
    want = rgcn_reference(graph, x, w)
    dense = np.einsum("rij,jg,rgf->if", graph.to_dense(), x, w)
    np.testing.assert_allclose(want, dense, atol=1e-10)
    for order in R.ORDERS:
        plan = R.plan_rgcn(graph.shape, graph.relation_nnz(), f_in, f_out, "float32", order,
                           piece=piece)
        assert plan.order == order
        np.testing.assert_allclose(R.execute_rgcn(plan, graph, x, w), want, atol=1e-10)


def padded_rows(c: R.Composed) -> list[int]:
    """The padded row of every compact row: each relation's rows first in its tiles."""
    rows, start = [], 0
    for count in c.counts:
        rows += range(start, start + count)
        start += -(-count // c.layout.tile) * c.layout.tile
    assert start == c.layout.padded and len(c.take) == c.layout.padded
    assert list(c.tiles) == [r for r, n in enumerate(c.counts)
                             for _ in range(-(-n // c.layout.tile))]
    return rows


@settings(max_examples=25)
@given(T.relational_graphs(), PIECES)
def test_composed_operands(graph, piece):
    rels, rows, cols = graph.shape
    vals = graph.values()
    dense = graph.to_dense()
    tf = R.compose(graph, "transform-first", piece)
    sources = sorted({(r, c) for r, c in zip(graph.rel, graph.col)})
    at = padded_rows(tf)
    assert tf.compact == len(sources) and tf.first.shape == (rows, tf.layout.padded)
    assert tf.counts == np.bincount([r for r, _ in sources], minlength=rels).tolist()
    assert [tf.take[k] for k in at] == [c for _, c in sources]   # relation-major, then column
    assert not np.any(np.delete(tf.take, at))                      # padding gathers column 0
    assert tf.layout.longest == (max(np.bincount(graph.row, minlength=1)),)
    # B holds every edge once, at (row, its source's padded row)
    b = tf.first.to_dense()
    for r, i, j, v in zip(graph.rel, graph.row, graph.col, vals):
        assert b[i, at[sources.index((r, j))]] == v
    assert np.count_nonzero(b) == np.count_nonzero(vals)

    af = R.compose(graph, "aggregate-first", piece)
    span = (R.piece_entries(max(np.bincount(graph.row, minlength=1))) if piece is None
            else piece) or graph.nnz
    pieces = []   # (relation, row, columns): each pair's columns in order, span at a time
    for r, i in sorted({(r, i) for r, i in zip(graph.rel, graph.row)}):
        js = sorted(graph.col[(graph.rel == r) & (graph.row == i)])
        pieces += [(r, i, js[k:k + span]) for k in range(0, len(js), span)]
    at = padded_rows(af)
    assert af.compact == len(pieces) and [af.take[k] for k in at] == [i for _, i, _ in pieces]
    assert af.counts == np.bincount([r for r, _, _ in pieces], minlength=rels).tolist()
    c, s = af.first.to_dense(), af.second.to_dense()
    assert c.shape == (af.layout.padded, cols) and s.shape == (rows, af.layout.padded)
    for k, (r, i, js) in zip(at, pieces):
        want = np.zeros(cols)
        want[js] = dense[r, i, js]
        assert np.array_equal(c[k], want)                         # the piece's part of A_r[i]
        assert np.array_equal(s[:, k], np.eye(rows)[i])           # back to row i
    assert not np.any(np.delete(c, at, axis=0)) and not np.any(np.delete(s, at, axis=1))
    assert af.layout.longest == (max([len(js) for *_, js in pieces], default=0),
                                 max(np.bincount([i for _, i, _ in pieces], minlength=1)))
    # S @ C sums the pieces: the union of all relations, with values added
    np.testing.assert_allclose(spmm_csr(af.second, c), dense.sum(0), atol=1e-12)


def test_tiles_and_pieces():
    assert R.tile_rows(0, 0) == 16 and R.tile_rows(10**9, 1) == 2048
    assert R.tile_rows(41768, 90) == 256 and R.tile_rows(8822071, 266) == 2048
    assert [R.piece_entries(n) for n in (0, 64, 65, 917, 63395, 10**9)] == \
        [8, 8, 16, 32, 256, 4096]
    lay = R.Layout(100, 16, 8, (5,))
    assert lay.padded == 128


def test_cost_model_follows_the_feature_sizes():
    shape, nnz = (8, 50000, 50000), [40000] * 8   # rows of at most 7 edges: bytes decide
    for dtype in ("float16", "float32"):
        assert R.plan_rgcn(shape, nnz, 16, 256, dtype).order == "aggregate-first"  # narrow X
        assert R.plan_rgcn(shape, nnz, 256, 16, dtype).order == "transform-first"  # narrow XW
    p = R.plan_rgcn(shape, nnz, 16, 256, order="transform-first")
    assert p.order == "transform-first" and p.costs["transform-first"] > p.costs["aggregate-first"]
    assert "* aggregate-first" in R.plan_rgcn(shape, nnz, 16, 256).table()
    assert p.compact["aggregate-first"] == p.compact["transform-first"]   # no row to split
    few = R.Layout(100, 16, 8, (7,))
    exact = R.plan_rgcn(shape, nnz, 256, 16, layouts={"transform-first": few})
    assert exact.layouts["transform-first"] == few and exact.order == "transform-first"
    assert R.distinct_estimate(10, 0) == 0 and R.distinct_estimate(10, 3) <= 3
    assert 9 < R.distinct_estimate(10, 1000) <= 10


def test_cost_model_follows_the_longest_row():
    """Transform-first's one SpMM lasts at least B's longest row (a hub gathers its edges one
    round trip after another); aggregate-first's pieces bound its rows."""
    shape, nnz = (8, 5000, 5000), [4000] * 8
    assert R.plan_rgcn(shape, nnz, 32, 32, row_max=7).order == "transform-first"
    hub = R.plan_rgcn(shape, nnz, 32, 32, row_max=3000)
    assert hub.order == "aggregate-first" and hub.piece == 64
    assert hub.layouts["aggregate-first"].longest[0] == 64
    whole = R.plan_rgcn(shape, nnz, 32, 32, row_max=3000, piece=0)
    assert whole.layouts["aggregate-first"].longest[0] == 3000


#: ``pitgen bench rgcn`` on an H100 (2026-11-23; docs/rgcn.md, "Measured"): GPU ms of
#: (transform-first, aggregate-first) by (graph, dtype, F), as the code ran then: CSR SpMMs,
#: aggregate-first's pairs whole, the transforms one matmul per relation (common to both).
MEASURED = {
    ("aifb", "float32", 32): (1.6881, 1.3643), ("aifb", "float32", 64): (1.5891, 1.2938),
    ("aifb", "float16", 32): (1.5869, 1.1708), ("aifb", "float16", 64): (1.4516, 2.3123),
    ("mutag", "float32", 32): (1.1743, 0.8214), ("mutag", "float32", 64): (1.4655, 0.7524),
    ("mutag", "float16", 32): (1.4834, 1.1588), ("mutag", "float16", 64): (1.8010, 2.3449),
    ("bgs", "float32", 32): (7.1677, 3.8621), ("bgs", "float32", 64): (7.0423, 4.2137),
    ("bgs", "float16", 32): (11.6193, 4.9647), ("bgs", "float16", 64): (11.7579, 5.5575),
    ("am", "float32", 32): (25.8990, 9.4560), ("am", "float32", 64): (26.1944, 11.7777),
    ("am", "float16", 32): (40.0838, 10.7381), ("am", "float16", 64): (40.2543, 13.2270)}
#: Aggregate-first's fp16 F=64 times on the small graphs: ~1.15 ms above its F=32 times on both,
#: a constant no term of the model (bytes, FLOPs, launches, longest rows) has, so the model
#: does not reproduce transform-first winning there (docs/rgcn.md).
UNEXPLAINED = {("aifb", "float16", 64), ("mutag", "float16", 64)}


#: What the model is given for each bench graph, recorded from pitgen.graphs (shape, edges per
#: relation, longest row, each order's exact layout with pairs whole): the graphs MEASURED ran
#: on. Recorded because generating am and bgs and their layouts took 10 s of a 2-core CI run;
#: test_recorded_graph_statistics_are_the_generators regenerates the small two.
STATS = json.loads((Path(__file__).parent / "rgcn_bench_graphs.json").read_text())


def _stats(name: str) -> tuple:
    st_ = STATS[name]
    return (tuple(st_["shape"]), st_["relation_nnz"], st_["row_max"],
            {o: R.Layout(l["compact"], l["tile"], l["tiles"], tuple(l["longest"]))
             for o, l in st_["layouts"].items()})


@pytest.fixture(scope="module")
def bench_graphs() -> dict:
    """The bench's graphs as the model sees them (STATS)."""
    assert sorted(STATS) == sorted(RGCN_GRAPHS)
    return {name: _stats(name) for name in RGCN_GRAPHS}


@pytest.mark.parametrize("name", ["aifb", "mutag"])
def test_recorded_graph_statistics_are_the_generators(name):
    g = make_relational(name)
    assert _stats(name) == (g.shape, g.relation_nnz().tolist(), R._row_max(g),
                            {o: R.layout(g, o, piece=0) for o in R.ORDERS})


@pytest.mark.parametrize("case", sorted(MEASURED))
def test_cost_model_picks_the_measured_order(bench_graphs, case):
    name, dtype, feat = case
    shape, nnz_r, row_max, layouts = bench_graphs[name]
    plan = R.plan_rgcn(shape, nnz_r, feat, feat, dtype, row_max=row_max, piece=0,
                       layouts=layouts)
    tf, af = MEASURED[case]
    winner = "transform-first" if tf < af else "aggregate-first"
    if case in UNEXPLAINED:
        assert plan.order == "aggregate-first" != winner
        return
    assert plan.order == winner
    if name in ("bgs", "am"):   # device bound: the gap itself, within 25 %
        gap = (plan.costs["transform-first"] - plan.costs["aggregate-first"]) * 1e3
        assert gap == pytest.approx(tf - af, rel=0.25)


@pytest.mark.parametrize("name", RGCN_GRAPHS)
def test_pieces_shorten_the_bench_graphs_rows(bench_graphs, name):
    """With pieces (the default) aggregate-first's longest rows, estimated before composing,
    are shorter than the measured whole pairs', and auto picks it."""
    shape, nnz_r, row_max, layouts = bench_graphs[name]
    for dtype in ("float32", "float16"):
        plan = R.plan_rgcn(shape, nnz_r, 32, 32, dtype, row_max=row_max)
        assert plan.order == "aggregate-first"
        assert max(plan.layouts["aggregate-first"].longest) < \
            max(layouts["aggregate-first"].longest)


def test_plan_and_executor_errors():
    g = Relational((2, 3, 3), [0, 1], [0, 2], [1, 1])
    with pytest.raises(PlanError, match="unknown RGCN order"):
        R.plan_rgcn(g.shape, g.relation_nnz(), 4, 4, order="both")
    with pytest.raises(ShapeError, match="dtype bfloat16"):
        R.plan_rgcn(g.shape, g.relation_nnz(), 4, 4, dtype="bfloat16")
    with pytest.raises(ShapeError, match="relation_nnz needs 2"):
        R.plan_rgcn(g.shape, [1], 4, 4)
    with pytest.raises(ShapeError, match="f_out must be an integer >= 1"):
        R.plan_rgcn(g.shape, g.relation_nnz(), 4, 0)
    with pytest.raises(ShapeError, match="piece must be an integer >= 0"):
        R.plan_rgcn(g.shape, g.relation_nnz(), 4, 4, piece=-1)
    plan = R.plan_rgcn(g.shape, g.relation_nnz(), 4, 2)
    with pytest.raises(ShapeError, match="W must be"):
        R.execute_rgcn(plan, g, np.ones((3, 4)), np.ones((3, 4, 2)))
    with pytest.raises(ShapeError, match="plan for"):
        R.execute_rgcn(plan, g, np.ones((3, 4)), np.ones((2, 4, 3)))
    with pytest.raises(ShapeError, match="W must be"):
        rgcn_reference(g, np.ones((3, 4)), np.ones((2, 5, 2)))


@pytest.mark.parametrize("piece", [0, 3, None])
def test_layout_without_composing_is_the_composed_layout(piece):
    g = make_relational("mutag")
    for order in R.ORDERS:
        assert R.layout(g, order, piece) == R.compose(g, order, piece).layout
