"""GPU tests of RGCN inference (pitgen.ops.rgcn): the operands composed on the GPU (tiles,
aggregate-first pieces) equal the NumPy composition; both orders (and "auto") agree with the
float64 reference on drawn relational graphs (empty relations, isolated nodes, hubs split into
pieces, odd feature sizes) with poisoned outputs and fresh inputs; no host sync after the first
call; RGCNConv; bad input raises pitgen errors."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pitgen import PlanError, ShapeError, graphs
from pitgen import testing as T
from pitgen.graph.device import DeviceCSR
from pitgen.graph.formats import Relational
from pitgen.ops import rgcn as R
from pitgen.reference import rgcn_reference

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="GPU tests need torch")

DTYPES = ("float32", "float16")
#: float32: torch's batched matmul may run TF32 on tensor cores
TOL = {"float32": "tf32", "float16": "float16"}
GPU_SETTINGS = settings(max_examples=T.examples(10), deadline=None)
#: Partial results each order stores in the dtype before the output (pitgen.testing.E_ROUND):
#: transform-first XW; aggregate-first H = C X and Z = H W.
ROUNDINGS = {R.TRANSFORM_FIRST: 1, R.AGGREGATE_FIRST: 2}
GRAPHS = T.relational_graphs(max_relations=6, max_rows=40, max_cols=40)


def rounded(g: Relational, dtype: str, values: np.ndarray | None = None) -> Relational:
    """``g`` with its values (or ``values``) rounded to dtype: what the device holds."""
    v = g.values() if values is None else values
    return Relational(g.shape, g.rel, g.row, g.col, v.astype(dtype).astype(np.float64))


def operand(rng, shape, dtype, scale=1.0):
    t = torch.from_numpy((rng.standard_normal(shape) * scale).astype(np.float32))
    t = t.to("cuda", getattr(torch, dtype))
    return t, t.double().cpu().numpy()


def check(g: Relational, y, x64, w64, dtype: str, roundings: int, extra=None) -> None:
    """y against the float64 reference of the rounded graph, every element held to the
    root-sum-square of its terms A[r,i,j] X[j,g] W[r,g,f] (and ``extra``'s: (values, sums of
    squared terms) added to the output) and ``roundings`` intermediates stored in dtype."""
    want = rgcn_reference(g, x64, w64)
    squares = T.term_scale(rgcn_reference, g, x64, w64) ** 2
    if extra is not None:
        want, squares = want + extra[0], squares + extra[1]
    T.assert_close(y, want, TOL[dtype], scale=np.sqrt(squares), roundings=roundings)


def roundings(d: R.DeviceRelational, f_in: int, f_out: int, order: str) -> int:
    """The intermediates stored in the dtype by the order the next ``rgcn(d, ..., order)``
    runs (ask before the call: "auto" plans again once an order is composed)."""
    return ROUNDINGS[d.plan(f_in, f_out, order).order]


@GPU_SETTINGS
@given(GRAPHS, st.sampled_from(R.ORDERS))
def test_composed_on_the_gpu_equals_numpy(graph, order):
    d = R.DeviceRelational.from_host(graph, "float32")
    c = d.composed(order)
    want = R.compose(rounded(graph, "float32"), order)
    assert (c.layout, c.counts) == (want.layout, want.counts)
    np.testing.assert_array_equal(c.take.cpu().numpy(), want.take)
    np.testing.assert_array_equal(c.tiles.cpu().numpy(), want.tiles)
    for got, ref in ((c.first, want.first), (c.second, want.second)):
        if ref is None:
            assert got is None
            continue
        assert got.shape == ref.shape
        np.testing.assert_array_equal(got.indptr.cpu().numpy(), ref.indptr)
        np.testing.assert_array_equal(got.indices.cpu().numpy(), ref.indices)
        np.testing.assert_array_equal(got.values.double().cpu().numpy(), ref.values())


@GPU_SETTINGS
@given(GRAPHS, st.sampled_from(DTYPES), st.sampled_from(("auto", *R.ORDERS)),
       st.sampled_from([(1, 1), (7, 3), (32, 32), (33, 65), (64, 16)]), st.integers(0, 2**31))
def test_rgcn_matches_the_reference(graph, dtype, order, feats, seed):
    rng = np.random.default_rng(seed)
    f_in, f_out = feats
    g = rounded(graph, dtype)
    d = R.DeviceRelational.from_host(graph, dtype)
    x, x64 = operand(rng, (g.shape[2], f_in), dtype)
    w, w64 = operand(rng, (g.shape[0], f_in, f_out), dtype, f_in ** -0.5)
    out = T.poison(torch.empty((g.shape[1], f_out), dtype=x.dtype, device="cuda"))
    n = roundings(d, f_in, f_out, order)
    y = R.rgcn(d, x, w, order=order, out=out)
    assert y is out
    check(g, y, x64, w64, dtype, n)
    n = roundings(d, f_in, f_out, order)
    check(g, R.rgcn(d, x, w, order=order), x64, w64, dtype, n)   # composed once, reused


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("order", R.ORDERS)
def test_from_relations(dtype, order):
    """Relation counts and the longest row counted on the GPU; hub pairs split into pieces."""
    rng = np.random.default_rng(1)
    g = graphs.make_relational("mutag", seed=2, scale=0.02)
    values = rng.uniform(0.5, 1.5, g.nnz)
    g = rounded(g, dtype, values)
    mats = [DeviceCSR.from_host(g.relation(r), dtype) for r in range(g.shape[0])]
    d = R.DeviceRelational.from_relations(mats)
    assert d.relation_nnz() == g.relation_nnz().tolist()
    assert d.row_max() == int(np.bincount(g.row).max())
    x, x64 = operand(rng, (g.shape[2], 24), dtype)
    w, w64 = operand(rng, (g.shape[0], 24, 40), dtype, 0.2)
    check(g, R.rgcn(d, x, w, order=order), x64, w64, dtype, ROUNDINGS[order])
    c = d.composed(order)
    assert c.layout == R.compose(g, order).layout
    if order == R.AGGREGATE_FIRST:   # some pair longer than a piece was split
        assert c.compact > len({(r, i) for r, i in zip(g.rel, g.row)})


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_host_sync_after_the_first_call(dtype):
    rng = np.random.default_rng(5)
    g = rounded(graphs.make_relational("aifb", seed=0, scale=0.05), dtype)
    d = R.DeviceRelational.from_host(g, dtype)
    x, x64 = operand(rng, (g.shape[2], 16), dtype)
    w, w64 = operand(rng, (g.shape[0], 16, 8), dtype, 0.25)
    orders = ("auto", *R.ORDERS, "auto")
    for order in orders:   # compose and compile outside the check
        R.rgcn(d, x, w, order=order)
    out = torch.empty((g.shape[1], 8), dtype=x.dtype, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        ys = [R.rgcn(d, x, w, order=order).clone() for order in orders[:-1]]
        R.rgcn(d, x, w, out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for order, y in zip(orders, ys):
        check(g, y, x64, w64, dtype, roundings(d, 16, 8, order))


@pytest.mark.parametrize("dtype", DTYPES)
def test_generated_graph_both_orders_and_auto(dtype):
    rng = np.random.default_rng(3)
    g = rounded(graphs.make_relational("aifb", seed=0, scale=0.3), dtype)
    d = R.DeviceRelational.from_host(g, dtype)
    x, x64 = operand(rng, (g.shape[2], 32), dtype)
    w, w64 = operand(rng, (g.shape[0], 32, 32), dtype, 0.2)
    for order in ("auto", *R.ORDERS):
        n = roundings(d, 32, 32, order)
        check(g, R.rgcn(d, x, w, order=order), x64, w64, dtype, n)
    assert d.plan(32, 32).compact == {o: d.composed(o).compact for o in R.ORDERS}


@pytest.mark.parametrize("dtype", DTYPES)
def test_rgcn_conv(dtype):
    import pitgen.nn

    rng = np.random.default_rng(4)
    g = rounded(graphs.make_relational("aifb", seed=1, scale=0.1), dtype)
    d = R.DeviceRelational.from_host(g, dtype)
    layer = pitgen.nn.RGCNConv(16, 8, g.shape[0], device="cuda", dtype=getattr(torch, dtype))
    with torch.no_grad():
        layer.bias.uniform_(-1, 1)
    x, x64 = operand(rng, (g.shape[2], 16), dtype)
    n = roundings(d, 16, 8, layer.order)
    with torch.no_grad():
        y = layer(d, x)
    w64, root, bias = (p.detach().double().cpu().numpy() for p in
                       (layer.weight, layer.root, layer.bias))
    # the layer stores rgcn's output, then y + x root, in dtype before adding the bias
    check(g, y, x64, w64, dtype, n + 2,
          extra=(x64 @ root + bias, x64 ** 2 @ root ** 2 + bias ** 2))
    assert set(layer.state_dict()) == {"weight", "root", "bias"}
    with pytest.raises(PlanError, match="inference only"):
        layer(d, x)
    with pytest.raises(PlanError, match="unknown RGCN order"):
        pitgen.nn.RGCNConv(4, 4, 2, order="sideways")


def test_bad_input_raises_pitgen_errors():
    g = Relational((2, 3, 4), [0, 1], [0, 2], [1, 3])
    d = R.DeviceRelational.from_host(g, "float16")
    x = torch.ones((4, 8), dtype=torch.float16, device="cuda")
    w = torch.ones((2, 8, 4), dtype=torch.float16, device="cuda")
    assert tuple(R.rgcn(d, x, w).shape) == (3, 4)
    with pytest.raises(ShapeError, match="dtype float32"):
        R.rgcn(d, x.float(), w)
    with pytest.raises(ShapeError, match="dim 0 must be 4"):
        R.rgcn(d, x[:3], w)
    with pytest.raises(ShapeError, match="dim 1 must be 8"):
        R.rgcn(d, x, w[:, :4])
    with pytest.raises(ShapeError, match="DeviceRelational"):
        R.rgcn(g, x, w)
    with pytest.raises(PlanError, match="unknown RGCN order"):
        R.rgcn(d, x, w, order="both")
    with pytest.raises(ShapeError, match="one shape and one dtype"):
        R.DeviceRelational.from_relations([DeviceCSR.from_host(g.relation(0), "float16"),
                                           DeviceCSR.from_host(g.relation(1), "float32")])
