"""CSR / ELL / BSR / hyb layouts and their float64 SpMM / SDDMM references (pitgen.graph.formats),
plus the relational (typed COO) graph and the generated graphs of pitgen.graphs."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pitgen import ShapeError
from pitgen import testing as T
from pitgen import graphs as make_graphs
from pitgen.graph.formats import BSR, CSR, ELL, Hyb, Relational, load_graph
from pitgen.reference import (sddmm_csr, sddmm_bsr, sddmm_ell, sddmm_hyb, spmm_csr, spmm_bsr,
                              spmm_ell, spmm_hyb)


def matrices():
    """(CSR, the same matrix dense), the dense one built entry by entry from the CSR arrays: every
    kind pitgen.testing draws (empty rows, dense and long rows, power-law rows, one column, no
    non-zero, empty shapes)."""
    def with_dense(csr: CSR) -> tuple[CSR, np.ndarray]:
        dense = np.zeros(csr.shape)
        for r in range(csr.shape[0]):
            for p in range(csr.indptr[r], csr.indptr[r + 1]):
                dense[r, csr.indices[p]] = csr.data[p]
        return csr, dense
    return T.csr_matrices(max_rows=24, max_cols=40, densities=(0.0, 0.05, 0.2, 0.6)).map(with_dense)


def rel_err(got, want):
    return np.abs(got - want).max(initial=0) / max(np.abs(want).max(initial=0), 1.0)


# -- round trips -----------------------------------------------------------------------------

@given(matrices())
def test_csr_round_trips(m):
    csr, dense = m
    assert np.array_equal(csr.to_dense(), dense)
    assert np.array_equal(csr.row_lengths(), (dense != 0).sum(1))
    assert csr.indptr.dtype == csr.indices.dtype == np.int32
    sp = pytest.importorskip("scipy.sparse")
    assert np.array_equal(CSR.from_scipy(sp.coo_matrix(dense)).to_dense(), dense)
    assert np.array_equal(CSR.from_dense(dense != 0).to_dense(), (dense != 0).astype(float))


def test_from_scipy_sums_duplicates_and_sorts():
    sp = pytest.importorskip("scipy.sparse")
    coo = sp.coo_matrix(([1.0, 2.0, 3.0], ([0, 0, 1], [2, 2, 0])), shape=(2, 3))
    csr = CSR.from_scipy(coo)
    assert csr.indices.tolist() == [2, 0] and csr.data.tolist() == [3.0, 3.0]


@given(matrices(), st.integers(1, 6))
def test_ell_and_bsr_round_trip(m, b):
    csr, dense = m
    ell = ELL.from_csr(csr)
    assert ell.width == csr.row_lengths().max(initial=0)
    assert np.array_equal(ell.to_dense(), dense)
    assert np.array_equal(ELL.from_csr(csr, width=ell.width + 3).to_dense(), dense)
    bsr = BSR.from_csr(csr, b)
    assert bsr.blocks.shape[1:] == (b, b)
    assert np.array_equal(bsr.to_dense(), dense)
    assert bsr.mask.sum() == csr.nnz


@given(matrices(), st.integers(1, 5), st.integers(0, 4))
def test_hyb_reproduces_matrix_with_minimal_buckets(m, c, k):
    csr, dense = m
    hyb = Hyb.from_csr(csr, c, k)
    assert np.array_equal(hyb.to_dense(), dense)
    cap, size = 1 << k, hyb.part_size
    rows = csr.row_ids()
    per_part = {}  # (part, row) -> non-zeros of that row in that part
    for r, col in zip(rows.tolist(), csr.indices.tolist()):
        per_part[col // size, r] = per_part.get((col // size, r), 0) + 1
    seen = {}
    for bk in hyb.buckets:
        assert bk.cols.shape == bk.vals.shape == (bk.row_ids.size, bk.width)
        assert ((bk.cols < 0) | (bk.cols // size == bk.part)).all()
        assert ((bk.cols >= 0).sum(1) >= 1).all()          # no all-padding rows
        for r, n_live in zip(bk.row_ids.tolist(), (bk.cols >= 0).sum(1).tolist()):
            total = per_part[bk.part, r]
            if total <= cap:                                # minimal width: 2^(e-1) < n <= 2^e
                assert n_live == total and bk.width // 2 < total <= bk.width
            else:                                           # cut into rows of width 2^k
                assert bk.width == cap
            seen[bk.part, r] = seen.get((bk.part, r), 0) + 1
        cut = any(per_part[bk.part, r] > cap for r in bk.row_ids.tolist())
        assert bk.needs_atomics == (c > 1 or cut)
    assert seen == {key: -(-n // cap) for key, n in per_part.items()}
    stats = hyb.stats()
    assert stats["nnz"] == csr.nnz
    assert stats["slots"] == sum(b["rows"] * b["width"] for b in stats["buckets"])
    assert stats["padding_ratio"] >= 1.0


@given(matrices(), st.integers(1, 4), st.integers(0, 3), st.sampled_from(["atomic", "pieces"]))
def test_hyb_write_plan_writes_every_row_once(m, c, k, cut):
    """The GPU SpMM's plan in NumPy. Bucket rows that need atomics add into workspace rows and a
    finish pass writes those and the empty rows; or (c == 1, cut="pieces") a cut row's pieces
    store partial rows that the last piece sums and the empty rows are zeroed. Other rows are
    stored by their only bucket row. Every row is written exactly once."""
    csr, dense = m
    hyb = Hyb.from_csr(csr, c, k)
    plan = hyb.write_plan()
    pieces = cut == "pieces" and c == 1
    x = np.random.default_rng(c * 10 + k).standard_normal((csr.shape[1], 3))
    y = np.full((csr.shape[0], 3), np.nan)
    ws = np.zeros((int((plan["ws_index"] >= 0).sum()), 3))
    info = plan["cut_info"]
    partials = np.full((int(info[:, 1].sum()), 3), np.nan)
    left = info[:, 1].copy()                 # pieces still to finish, per cut row
    written = np.zeros(csr.shape[0], int)
    br = 0
    for bk in hyb.buckets:
        for i, r in enumerate(bk.row_ids.tolist()):
            live = bk.cols[i] >= 0
            row = bk.vals[i, live] @ x[bk.cols[i, live]]
            cid = plan["cut_index"][r]
            if pieces and cid >= 0:
                first, n, base = info[cid]
                assert 0 <= br - first < n
                partials[base + br - first] = row
                left[cid] -= 1
                if left[cid] == 0:           # the last piece sums the row
                    y[r] = partials[base:base + n].sum(0)
                    written[r] += 1
            elif bk.needs_atomics and not pieces:
                ws[plan["ws_index"][r]] += row
            else:
                assert plan["ws_index"][r] < 0 or pieces
                y[r] = row
                written[r] += 1
            br += 1
    for r in (plan["empty_rows"] if pieces else plan["fix_rows"]).tolist():
        y[r] = ws[plan["ws_index"][r]] if plan["ws_index"][r] >= 0 else 0.0
        written[r] += 1
    assert (written == 1).all()
    assert not pieces or (left == 0).all()
    np.testing.assert_allclose(y, dense @ x, atol=1e-12)


# -- operators through every format ----------------------------------------------------------

@settings(max_examples=40)
@given(matrices(), st.integers(1, 5), st.integers(1, 4), st.integers(0, 3), st.integers(1, 4))
def test_spmm_sddmm_every_format(m, f, c, k, b):
    csr, dense = m
    rng = np.random.default_rng(f * 131 + c * 7 + k)
    x = rng.standard_normal((dense.shape[1], f))
    u = rng.standard_normal((dense.shape[0], f))
    v = rng.standard_normal((dense.shape[1], f))
    y_ref = dense @ x
    e_ref = (u @ v.T)[dense != 0]
    ell, bsr, hyb = ELL.from_csr(csr), BSR.from_csr(csr, b), Hyb.from_csr(csr, c, k)
    for got in (spmm_csr(csr, x), spmm_ell(ell, x), spmm_bsr(bsr, x), spmm_hyb(hyb, x)):
        assert got.shape == y_ref.shape and rel_err(got, y_ref) <= 1e-12
    for got in (sddmm_csr(csr, u, v), sddmm_ell(ell, u, v), sddmm_bsr(bsr, u, v),
                sddmm_hyb(hyb, u, v)):
        assert got.shape == e_ref.shape and rel_err(got, e_ref) <= 1e-12


def test_operand_shapes_checked():
    csr = CSR.from_dense(np.eye(3))
    with pytest.raises(ShapeError, match="X must be 2-D with 3 rows"):
        spmm_csr(csr, np.ones((2, 4)))
    with pytest.raises(ShapeError, match="same feature width"):
        sddmm_csr(csr, np.ones((3, 2)), np.ones((3, 3)))


# -- bad inputs ------------------------------------------------------------------------------

I32 = np.int32


@pytest.mark.parametrize("shape, indptr, indices, data, message", [
    ((2, 3), [0, 2, 3], [2, 1, 0], None, "unsorted column indices in row 0"),
    ((2, 3), [0, 1, 3], [0, 1, 1], None, "duplicate column indices in row 1"),
    ((3, 3), [0, 2, 1, 3], [0, 1, 2], None, "not monotone"),
    ((2, 3), [1, 2, 3], [0, 1, 2], None, "start at 0"),
    ((2, 3), [0, 1], [0], None, "wrong length"),
    ((2, 3), [0, 1, 2], [0, 1, 2], None, "last entry 2 != nnz = 3"),
    ((2, 3), [0, 1, 2], [0, 3], None, "out of range.*row 1"),
    ((2, 3), [0, 1, 2], [0, -1], None, "out of range"),
    ((2, 3), [0, 1, 2], [0, 1], [1.0], "data length"),
])
def test_bad_csr_raises(shape, indptr, indices, data, message):
    with pytest.raises(ShapeError, match=message):
        CSR(shape, np.array(indptr, I32), np.array(indices, I32), data)


def test_index_dtypes_checked():
    with pytest.raises(ShapeError, match="mixed index dtypes"):
        CSR((1, 2), np.array([0, 1], np.int64), np.array([1], np.int32))
    with pytest.raises(ShapeError, match="non-integer"):
        CSR((1, 2), np.array([0, 1], I32), np.array([1.0]))


def test_ell_width_too_small_names_row():
    csr = CSR.from_dense(np.array([[1, 0, 0], [1, 1, 1], [1, 1, 0]]))
    with pytest.raises(ShapeError, match="row 1 has 3 non-zeros"):
        ELL.from_csr(csr, width=2)


# -- synthetic graphs ------------------------------------------------------------------------

SMALL = ["cora", "citeseer", "pubmed", "ppi"]


@pytest.mark.parametrize("name", SMALL)
@pytest.mark.parametrize("scale", [0.01, 0.05])
def test_make_graph_sizes_and_skew(name, scale):
    nodes, edges, _ = make_graphs.GRAPHS[name]
    g = make_graphs.make_graph(name, seed=0, scale=scale)
    assert g.shape == (round(nodes * scale),) * 2
    assert abs(g.nnz - edges * scale) <= 0.05 * edges * scale
    lengths = g.row_lengths()
    assert lengths.max() >= 5 * lengths.mean()      # heavy tail: hubs far above the mean
    g.validate()


@pytest.mark.parametrize("name,scale", [("aifb", 0.2), ("mutag", 0.05), ("bgs", 0.005),
                                        ("am", 0.001)])
def test_make_relational_matches_the_published_counts(name, scale):
    p = make_graphs.GRAPHS[name]
    g = make_graphs.make_relational(name, seed=1, scale=scale)
    n = round(p.nodes * scale)
    assert g.shape == (p.relations, n, n)
    assert abs(g.nnz - p.edges * scale) <= 0.05 * p.edges * scale
    sizes = g.relation_nnz()
    half = p.relations // 2
    assert np.array_equal(sizes[:half], sizes[half:])            # each relation and its inverse
    assert sizes.max() >= 5 * max(sizes.mean(), 1)               # skewed relation sizes
    fwd, inv = g.relation(0), g.relation(half)                   # inverse = transpose
    assert np.array_equal(fwd.to_dense(), inv.to_dense().T)
    assert make_graphs.make_graph(name, seed=1, scale=scale).nnz == g.union().nnz


def test_relational_validates_and_converts():
    rng = np.random.default_rng(0)
    dense = (rng.random((3, 5, 4)) < 0.3) * rng.standard_normal((3, 5, 4))
    rels = [CSR.from_dense(d) for d in dense]
    g = Relational.from_relations(rels)
    assert np.array_equal(g.to_dense(), dense) and g.relation_nnz().sum() == g.nnz
    for r in range(3):
        assert np.array_equal(g.relation(r).to_dense(), dense[r])
    assert np.array_equal(g.union().to_dense() != 0, (dense != 0).any(0))
    with pytest.raises(ShapeError, match="unsorted"):
        Relational((2, 2, 2), [1, 0], [0, 0], [0, 0])
    with pytest.raises(ShapeError, match="duplicate"):
        Relational((2, 2, 2), [0, 0], [1, 1], [0, 0])
    with pytest.raises(ShapeError, match=r"rel\[0\] = 2 is outside \[0, 2\)"):
        Relational((2, 2, 2), [2], [0], [0])
    with pytest.raises(ShapeError, match="different shapes"):
        Relational.from_relations([CSR.from_dense(np.eye(2)), CSR.from_dense(np.eye(3))])


def test_make_graph_deterministic():
    a, b = (make_graphs.make_graph("pubmed", seed=3, scale=0.02) for _ in range(2))
    assert np.array_equal(a.indptr, b.indptr) and np.array_equal(a.indices, b.indices)
    c = make_graphs.make_graph("pubmed", seed=4, scale=0.02)
    assert not np.array_equal(a.indices, c.indices)


def test_cli_writes_loadable_graphs(tmp_path, capsys):
    assert make_graphs.main([str(tmp_path), "--names", "cora,ppi", "--scale", "0.02"]) == 0
    g = load_graph(tmp_path / "cora.npz")
    want = make_graphs.make_graph("cora", scale=0.02)
    assert np.array_equal(g.indices, want.indices) and np.array_equal(g.indptr, want.indptr)
    assert load_graph(tmp_path / "ppi.npz").shape == (295, 295)
    assert make_graphs.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "ogbn-proteins" in out and "am" in out


def test_load_graph_plain_npz(tmp_path):
    g = make_graphs.make_graph("citeseer", scale=0.05)
    np.savez(tmp_path / "g.npz", indptr=g.indptr, indices=g.indices, shape=np.array(g.shape))
    back = load_graph(tmp_path / "g.npz")
    assert back.data is None and np.array_equal(back.to_dense(), g.to_dense())
    np.savez(tmp_path / "bad.npz", indptr=np.array([0, 2]), indices=np.array([1, 0]),
             shape=np.array([1, 2]))
    with pytest.raises(ShapeError, match="unsorted"):
        load_graph(tmp_path / "bad.npz")
