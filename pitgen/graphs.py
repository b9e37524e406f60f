"""Seeded graphs with the published sizes of SparseTIR's and RGCN's evaluation sets.

There is no network to download the data sets, so these stand-ins match what their papers and
loaders publish (docs/graphs.md lists each number with its source): node and edge counts of the
seven GNN graphs (cora ... reddit), and for the four RGCN graphs (aifb, mutag, bgs, am) also the
number of relations, each with its inverse, as DGL and PyG load them. Row degrees are
heavy-tailed (Pareto), columns drawn by a Zipf-like popularity, and relation sizes Zipf-like too,
so that format choices (ELL padding, hyb buckets) and the relation x row work lists face the
skew of real graphs. ``scale`` shrinks nodes and edges alike (reddit's 114M edges, AM's 12M).
Everything is vectorised NumPy and deterministic for a (name, seed, scale).

    python -m pitgen.graphs OUT_DIR [--names cora,pubmed] [--scale 0.1] [--seed 0]
    python -m pitgen.graphs --list
"""
from __future__ import annotations

import argparse
import sys
import zlib
from pathlib import Path
from typing import NamedTuple

import numpy as np

from pitgen.graph.formats import CSR, Relational, index_dtype

__all__ = ["Published", "GRAPHS", "GNN_GRAPHS", "RGCN_GRAPHS", "make_graph", "make_relational",
           "save_graph"]


class Published(NamedTuple):
    """What a data set's sources publish: nodes, (directed) edges, relations (1: untyped)."""

    nodes: int
    edges: int
    relations: int = 1


#: SparseTIR's GNN graphs (edges as its loaders count them: both directions of an undirected
#: edge, ogbn-arxiv's citations once) and the RGCN entity-classification graphs with inverse
#: relations and edges (DGL's and PyG's counts). Sources: docs/graphs.md.
GRAPHS: dict[str, Published] = {
    "cora": Published(2708, 10556),
    "citeseer": Published(3327, 9228),
    "pubmed": Published(19717, 88651),
    "ppi": Published(14755, 225270),
    "ogbn-arxiv": Published(169343, 1166243),
    "ogbn-proteins": Published(132534, 39561252),
    "reddit": Published(232965, 114615892),
    "aifb": Published(8285, 58086, 90),
    "mutag": Published(23644, 148454, 46),
    "bgs": Published(333845, 1832398, 206),
    "am": Published(1666764, 11976642, 266),
}
GNN_GRAPHS = ("cora", "citeseer", "pubmed", "ppi", "ogbn-arxiv", "ogbn-proteins", "reddit")
RGCN_GRAPHS = ("aifb", "mutag", "bgs", "am")

DEGREE_TAIL = 1.5      # Pareto index of row degrees: finite mean, infinite variance
POPULARITY = 0.8       # Zipf exponent of column popularity
RELATION_SKEW = 1.0    # Zipf exponent of relation sizes (a few relations hold most edges)
MAX_ROUNDS = 30


def _degrees(rng: np.random.Generator, n: int, m: int) -> np.ndarray:
    """Row degrees summing to exactly m, heavy-tailed, none above n (rows are deduplicated)."""
    w = rng.pareto(DEGREE_TAIL, n) + 1.0
    deg = np.zeros(n, np.int64)
    free = np.ones(n, bool)
    left = m
    while left > 0:  # hand out what capped rows could not take to the uncapped ones
        share = w * free / (w * free).sum() * left
        add = np.floor(share).astype(np.int64)
        spare = left - add.sum()
        add[np.argsort(share - add, kind="stable")[::-1][:spare]] += 1
        deg = np.minimum(deg + add, n)
        free = deg < n
        left = m - deg.sum()
    return deg


def _dense_rows(rng: np.random.Generator, rows: np.ndarray, deg: np.ndarray,
                logp: np.ndarray) -> np.ndarray:
    """Exact popularity-weighted sampling without replacement (Gumbel top-k) for rows that hold
    a large share of all columns, where drawing and deduplicating would hardly converge."""
    n = logp.size
    out = []
    chunk = max(1, 4_000_000 // n)
    for lo in range(0, rows.size, chunk):
        r = rows[lo:lo + chunk]
        score = logp + rng.gumbel(size=(r.size, n))
        rank = np.argsort(-score, axis=1)
        take = np.arange(n) < deg[r, None]
        out.append((r[:, None] * n + rank)[take])
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def _unique(keys: np.ndarray) -> np.ndarray:
    """Sorted distinct keys: np.unique's result, by a sort and a neighbour test (NumPy 2's
    hash-based unique is many times slower on tens of millions of keys)."""
    keys = np.sort(keys)
    return keys[np.concatenate(([True], keys[1:] != keys[:-1]))] if keys.size else keys


def _pattern(rng: np.random.Generator, n: int, m: int) -> np.ndarray:
    """Sorted distinct keys row * n + col of an n x n pattern with about m entries.

    Rows holding at least 1/8 of all columns are sampled exactly; the others draw
    popularity-skewed columns and drop duplicates, redrawing what is missing for a few rounds.
    """
    deg = _degrees(rng, n, m)
    pop = 1.0 / (rng.permutation(n) + 1.0) ** POPULARITY
    pop /= pop.sum()
    cdf = np.cumsum(pop)
    dense = deg * 8 >= n
    keys = _dense_rows(rng, np.flatnonzero(dense), deg, np.log(pop))
    need = np.where(dense, 0, deg)
    for _ in range(MAX_ROUNDS):
        if need.sum() <= 0.005 * m:
            break
        rows = np.repeat(np.arange(n, dtype=np.int64), need)
        u = rng.random(rows.size)
        cols = np.empty(rows.size, np.int64)
        by = np.argsort(u)   # sorted queries: a cache-friendly search, several times faster
        cols[by] = np.minimum(np.searchsorted(cdf, u[by]), n - 1)
        keys = _unique(np.concatenate([keys, rows * n + cols]))
        need = deg - np.bincount(keys // n, minlength=n)
    keys.sort()
    return keys


def _sized(name: str, scale: float) -> tuple[Published, int, int]:
    if name not in GRAPHS:
        raise KeyError(f"unknown graph {name!r}; known: {', '.join(GRAPHS)}")
    p = GRAPHS[name]
    n = max(1, round(p.nodes * scale))
    return p, n, min(round(p.edges * scale), n * n)


def _rng(name: str, seed: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def make_graph(name: str, seed: int = 0, scale: float = 1.0) -> CSR:
    """An n x n adjacency pattern with the named graph's node and edge counts times ``scale``
    (edges capped at n * n, which only very small scales of the dense graphs reach). For an
    RGCN graph: the union of its relations (:func:`make_relational`)."""
    p, n, m = _sized(name, scale)
    if p.relations > 1:
        return make_relational(name, seed, scale).union()
    keys = _pattern(_rng(name, seed), n, m)
    dt = index_dtype(n, keys.size)
    indptr = np.zeros(n + 1, dt)
    np.cumsum(np.bincount(keys // n, minlength=n), out=indptr[1:])
    return CSR((n, n), indptr, (keys % n).astype(dt))


def make_relational(name: str, seed: int = 0, scale: float = 1.0) -> Relational:
    """The named graph's relations: R/2 forward relations share half of the edges (relation
    sizes Zipf-like, in a seeded order) on a heavy-tailed pattern, and relation R/2 + r holds
    the inverse (transposed) edges of relation r, as DGL and PyG add them. A graph without
    relations is one relation."""
    p, n, m = _sized(name, scale)
    rng = _rng(name, seed)
    if p.relations == 1:
        keys, fwd = _pattern(rng, n, m), 1
        rel = np.zeros(keys.size, np.int64)
    else:
        fwd = p.relations // 2
        keys = _pattern(rng, n, min(m // 2, n * n))
        size = 1.0 / (rng.permutation(fwd) + 1.0) ** RELATION_SKEW
        rel = rng.choice(fwd, size=keys.size, p=size / size.sum())
    if p.relations > 1:   # inverse relations: transposed edges
        keys = np.concatenate([keys, (keys % n) * n + keys // n])
        rel = np.concatenate([rel, rel + fwd])
    keys = np.sort(rel * (n * n) + keys)   # (relation, row, col) order
    dt = index_dtype(n, p.relations, keys.size)
    rc = keys % (n * n)
    return Relational((p.relations, n, n), (keys // (n * n)).astype(dt), (rc // n).astype(dt),
                      (rc % n).astype(dt))


def save_graph(csr: CSR, path: Path) -> None:
    """scipy's save_npz when scipy is there (loadable by everyone), else a plain np.savez."""
    try:
        import scipy.sparse
    except ImportError:
        np.savez(path, indptr=csr.indptr, indices=csr.indices, shape=np.array(csr.shape))
        return
    m = scipy.sparse.csr_matrix((np.ones(csr.nnz, np.float32), csr.indices, csr.indptr),
                                shape=csr.shape)
    scipy.sparse.save_npz(path, m)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", type=Path, help="folder for <name>.npz")
    ap.add_argument("--names", default=",".join(GRAPHS), help="comma-separated graph names")
    ap.add_argument("--scale", type=float, default=1.0, help="shrink nodes and edges by this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--list", action="store_true", help="print the table of graphs and exit")
    args = ap.parse_args(argv)
    if args.list:
        print(f"{'name':<14} {'nodes':>8} {'edges':>10} {'mean deg':>8} {'relations':>9}")
        for name, p in GRAPHS.items():
            print(f"{name:<14} {p.nodes:>8} {p.edges:>10} {p.edges / p.nodes:>8.1f} "
                  f"{p.relations:>9}")
        return 0
    if args.out is None:
        ap.error("an output folder is needed (or --list)")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.names.split(","):
        csr = make_graph(name, seed=args.seed, scale=args.scale)
        path = args.out / f"{name}.npz"
        save_graph(csr, path)
        lengths = csr.row_lengths()
        print(f"{path}: {csr.shape[0]} nodes, {csr.nnz} edges, max degree {lengths.max()}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
