"""Deterministic synthetic power-law graphs with the sizes of SparseTIR's GNN benchmarks.

The real data sets need downloads; these stand-ins have the same node and edge counts and a
heavy-tailed row degree (Pareto), with columns drawn from a Zipf-like popularity, so that
format choices (ELL padding, hyb buckets) face the same skew.

    python -m pitgen.graph.synthetic OUT_DIR [--names cora,pubmed] [--scale 0.1] [--seed 0]
    python -m pitgen.graph.synthetic --list
"""
from __future__ import annotations

import argparse
import sys
import zlib
from pathlib import Path

import numpy as np

from pitgen.graph.formats import CSR, index_dtype

GRAPHS: dict[str, tuple[int, int]] = {
    "cora": (2708, 10556),
    "citeseer": (3327, 9228),
    "pubmed": (19717, 88651),
    "ppi": (14755, 225270),
    "ogbn-arxiv": (169343, 1166243),
    "ogbn-proteins": (132534, 39561252),
    "reddit": (232965, 114615892),
}

DEGREE_TAIL = 1.5   # Pareto index of row degrees: finite mean, infinite variance
POPULARITY = 0.8    # Zipf exponent of column popularity
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


def make_graph(name: str, seed: int = 0, scale: float = 1.0) -> CSR:
    """An n x n adjacency pattern with the named graph's node and edge counts times ``scale``
    (edges capped at n * n, which only very small scales of the dense graphs reach).

    Rows holding at least 1/8 of all columns are sampled exactly; the others draw
    popularity-skewed columns and drop duplicates, redrawing what is missing for a few rounds.
    """
    if name not in GRAPHS:
        raise KeyError(f"unknown graph {name!r}; known: {', '.join(GRAPHS)}")
    nodes, edges = GRAPHS[name]
    n = max(1, round(nodes * scale))
    m = min(round(edges * scale), n * n)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
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
        cols = np.minimum(np.searchsorted(cdf, rng.random(rows.size)), n - 1)
        keys = _unique(np.concatenate([keys, rows * n + cols]))
        need = deg - np.bincount(keys // n, minlength=n)
    keys.sort()
    dt = index_dtype(n, keys.size)
    indptr = np.zeros(n + 1, dt)
    np.cumsum(np.bincount(keys // n, minlength=n), out=indptr[1:])
    return CSR((n, n), indptr, (keys % n).astype(dt))


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
        print(f"{'name':<14} {'nodes':>8} {'edges':>10} {'mean deg':>8}")
        for name, (n, m) in GRAPHS.items():
            print(f"{name:<14} {n:>8} {m:>10} {m / n:>8.1f}")
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
