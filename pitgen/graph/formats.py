"""Composable sparse formats (CSR, ELL, BSR, hyb) and float64 NumPy reference operators.

This is the CPU ground truth for GNN SpMM / SDDMM kernels (SparseTIR's composable formats):
each format's ``spmm_*`` / ``sddmm_*`` walks the layout the way a kernel body would (per
bucket, per padded slot), so a test comparing it with the CSR reference proves that the layout
is complete and correct before any GPU code exists. Format arrays hold float64 values; a
pattern-only CSR (``data=None``) counts as all ones.
"""
from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import checks
from ..errors import DependencyError, FileError, PitgenError, ShapeError
from ..limits import INT64_MAX

__all__ = ["CSR", "Relational", "ELL", "BSR", "Hyb", "HybBucket", "load_graph", "index_dtype",
           "FORMATS", "BSR_BLOCKS", "SPMM_EXPR", "SDDMM_EXPR", "RGCN_EXPR"]

FORMATS = ("csr", "ell", "bsr", "hyb")
#: hyb's widest bucket is 2**k slots: an int32 width.
HYB_MAX_K = 30
BSR_BLOCKS = (8, 16, 32)
#: The graph operators: SpMM (aggregate neighbours) and SDDMM (a value per edge).
SPMM_EXPR = "Y[i,f] += A[i,j] * X[j,f]"
SDDMM_EXPR = "E[i,j] += U[i,f] * V[j,f]"
#: RGCN's aggregation over a relation-typed adjacency A[r, i, j] with a weight per relation.
RGCN_EXPR = "Y[i,f] += A[r,i,j] * X[j,g] * W[r,g,f]"


def index_dtype(*extents: int) -> np.dtype:
    """int32 when every extent fits (what kernels want), else int64."""
    sizes = [checks.integer(n, "extent", minimum=0) for n in extents]
    return np.dtype(np.int32) if max(sizes, default=0) < 2**31 else np.dtype(np.int64)


def _index_array(value: Any, what: str) -> np.ndarray:
    """A CSR index array; unsigned integers become int64 (kernels index with signed types)
    when their values fit."""
    a = checks.numeric_array(value, f"CSR {what}")
    if a.dtype.kind == "u":
        if a.size and int(a.max()) > INT64_MAX:
            raise ShapeError(f"CSR {what} holds {int(a.max())}, beyond int64")
        a = a.astype(np.int64)
    return a


def _row_of(indptr: np.ndarray, pos: int) -> int:
    """The row holding CSR position ``pos``: names the culprit in error messages."""
    return int(np.searchsorted(indptr, pos, side="right") - 1)


@dataclass(frozen=True)
class CSR:
    """Compressed sparse rows with sorted, unique column indices per row; validated on creation.

    ``indptr`` and ``indices`` share one integer dtype so that kernels index with one type.
    """
    shape: tuple[int, int]
    indptr: np.ndarray
    indices: np.ndarray
    data: np.ndarray | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", checks.extents(self.shape, "CSR shape", 2, minimum=0))
        object.__setattr__(self, "indptr", _index_array(self.indptr, "indptr"))
        object.__setattr__(self, "indices", _index_array(self.indices, "indices"))
        if self.data is not None:
            object.__setattr__(self, "data", checks.numeric_array(self.data, "CSR data"))
        self.validate()

    @property
    def nnz(self) -> int:
        return int(self.indices.shape[0])

    def validate(self) -> None:
        """Raise ShapeError naming the first broken CSR invariant a kernel would rely on."""
        if len(self.shape) != 2 or min(self.shape) < 0:
            raise ShapeError(f"CSR shape must be two non-negative extents, got {self.shape}")
        n_rows, n_cols = self.shape
        ip, ix = self.indptr, self.indices
        if ip.ndim != 1 or ix.ndim != 1:
            raise ShapeError(f"CSR indptr and indices must be 1-D, got shapes {ip.shape} and "
                             f"{ix.shape}")
        for name, arr in (("indptr", ip), ("indices", ix)):
            if not np.issubdtype(arr.dtype, np.integer):
                raise ShapeError(f"CSR {name} has non-integer dtype {arr.dtype}")
        if ip.dtype != ix.dtype:
            raise ShapeError(f"CSR mixed index dtypes: indptr is {ip.dtype}, indices is "
                             f"{ix.dtype}")
        if ip.shape[0] != n_rows + 1:
            raise ShapeError(f"CSR indptr has wrong length {ip.shape[0]}, expected n_rows + 1 = "
                             f"{n_rows + 1}")
        if ip[0] != 0:
            raise ShapeError(f"CSR indptr must start at 0, starts at {ip[0]}")
        steps = np.diff(ip)
        if (steps < 0).any():
            row = int(np.flatnonzero(steps < 0)[0])
            raise ShapeError(f"CSR indptr is not monotone: indptr[{row + 1}] = {ip[row + 1]} < "
                             f"indptr[{row}] = {ip[row]}")
        if ip[-1] != ix.shape[0]:
            raise ShapeError(f"CSR indptr's last entry {ip[-1]} != nnz = {ix.shape[0]} "
                             f"(length of indices)")
        if ix.size and (ix.min() < 0 or ix.max() >= n_cols):
            pos = int(np.flatnonzero((ix < 0) | (ix >= n_cols))[0])
            raise ShapeError(f"CSR column index out of range: indices[{pos}] = {ix[pos]} in row "
                             f"{_row_of(ip, pos)} is outside [0, {n_cols})")
        if ix.size > 1:
            same_row = np.ones(ix.size - 1, bool)
            starts = ip[1:-1]
            same_row[starts[(starts > 0) & (starts < ix.size)] - 1] = False
            d = np.diff(ix.astype(np.int64))
            for bad, what in ((same_row & (d < 0), "unsorted"),
                              (same_row & (d == 0), "duplicate")):
                if bad.any():
                    pos = int(np.flatnonzero(bad)[0]) + 1
                    raise ShapeError(f"CSR {what} column indices in row {_row_of(ip, pos)}: "
                                     f"{ix[pos - 1]} then {ix[pos]} at position {pos}")
        if self.data is not None and (self.data.ndim != 1 or self.data.shape[0] != ix.shape[0]):
            raise ShapeError(f"CSR data length {self.data.shape} != nnz = {ix.shape[0]}")

    @classmethod
    def from_dense(cls, mask_or_array: Any) -> CSR:
        """Non-zeros of a 2-D array in row-major order; a bool mask gives a pattern-only CSR."""
        a = checks.numeric_array(mask_or_array, "from_dense's array")
        if a.ndim != 2:
            raise ShapeError(f"from_dense needs a 2-D array, got shape {a.shape}")
        rows, cols = np.nonzero(a)
        dt = index_dtype(a.shape[1], rows.size)
        indptr = np.zeros(a.shape[0] + 1, dt)
        np.cumsum(np.bincount(rows, minlength=a.shape[0]), out=indptr[1:])
        data = None if a.dtype == np.bool_ else a[rows, cols]
        return cls(a.shape, indptr, cols.astype(dt), data)

    @classmethod
    def from_scipy(cls, m: Any) -> CSR:
        """Any scipy sparse matrix or array (via ``.tocsr()``), duplicates summed, rows sorted."""
        if not hasattr(m, "tocsr"):
            raise ShapeError(f"from_scipy needs a scipy sparse matrix or array, got "
                             f"{type(m).__name__}")
        m = m.tocsr(copy=True)
        m.sum_duplicates()
        dt = index_dtype(m.shape[1], m.nnz)
        return cls(m.shape, m.indptr.astype(dt), m.indices.astype(dt), np.asarray(m.data))

    def row_lengths(self) -> np.ndarray:
        return np.diff(self.indptr)

    def row_ids(self) -> np.ndarray:
        """The row of every non-zero, in CSR order (what a row-per-thread kernel recomputes)."""
        return np.repeat(np.arange(self.shape[0], dtype=self.indices.dtype), self.row_lengths())

    def values(self) -> np.ndarray:
        """float64 values of the non-zeros; ones for a pattern-only matrix."""
        if self.data is None:
            return np.ones(self.nnz)
        return self.data.astype(np.float64)

    def to_dense(self) -> np.ndarray:
        out = np.zeros(self.shape)
        out[self.row_ids(), self.indices] = self.values()
        return out


@dataclass(frozen=True)
class Relational:
    """A relation-typed adjacency A[r, i, j] as typed COO: edge e joins row ``row[e]`` to column
    ``col[e]`` in relation ``rel[e]``, sorted by (relation, row, column) without duplicates, so
    each relation's slice is that relation's CSR order. O(nnz) memory whatever the number of
    relations (a CSR per relation would hold relations x rows row pointers). ``data=None``: ones.
    """
    shape: tuple[int, int, int]   #: (relations, rows, cols)
    rel: np.ndarray
    row: np.ndarray
    col: np.ndarray
    data: np.ndarray | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        for name in ("rel", "row", "col"):
            a = np.asarray(getattr(self, name))
            object.__setattr__(self, name, a.astype(np.int64) if a.size == 0 else a)
        if self.data is not None:
            object.__setattr__(self, "data", np.asarray(self.data))
        self.validate()

    @property
    def nnz(self) -> int:
        return int(self.row.shape[0])

    def validate(self) -> None:
        """Raise ShapeError naming the first broken invariant (ranges, order, duplicates)."""
        if len(self.shape) != 3 or min(self.shape) < 0:
            raise ShapeError(f"Relational shape must be (relations, rows, cols), got {self.shape}")
        n = self.nnz
        for name in ("rel", "row", "col"):
            a = getattr(self, name)
            if a.ndim != 1 or a.shape[0] != n or not np.issubdtype(a.dtype, np.integer):
                raise ShapeError(f"Relational {name} must be 1-D integers of length nnz = {n}, "
                                 f"got {a.dtype} {a.shape}")
        if self.data is not None and self.data.shape != (n,):
            raise ShapeError(f"Relational data length {self.data.shape} != nnz = {n}")
        for name, extent in zip(("rel", "row", "col"), self.shape):
            a = getattr(self, name)
            if n and (a.min() < 0 or a.max() >= extent):
                pos = int(np.flatnonzero((a < 0) | (a >= extent))[0])
                raise ShapeError(f"Relational {name}[{pos}] = {a[pos]} is outside [0, {extent})")
        key = self.keys()
        if n > 1 and (np.diff(key) <= 0).any():
            pos = int(np.flatnonzero(np.diff(key) <= 0)[0]) + 1
            what = "duplicate" if key[pos] == key[pos - 1] else "unsorted"
            raise ShapeError(f"Relational {what} edge at position {pos}: (relation, row, col) = "
                             f"({self.rel[pos]}, {self.row[pos]}, {self.col[pos]})")

    def keys(self) -> np.ndarray:
        """int64 (relation, row, col) keys: strictly increasing for a valid graph."""
        _, rows, cols = self.shape
        return (self.rel.astype(np.int64) * rows + self.row) * cols + self.col

    @classmethod
    def from_relations(cls, relations: list[CSR]) -> Relational:
        """One CSR per relation (all of one shape) as typed COO."""
        if not relations:
            raise ShapeError("a relational graph needs at least one relation")
        shapes = {r.shape for r in relations}
        if len(shapes) != 1:
            raise ShapeError(f"relations of different shapes: {sorted(shapes)}")
        rows, cols = relations[0].shape
        dt = index_dtype(rows, cols, len(relations), sum(r.nnz for r in relations))
        rel = np.repeat(np.arange(len(relations), dtype=dt), [r.nnz for r in relations])
        data = None if all(r.data is None for r in relations) else \
            np.concatenate([r.values() for r in relations])
        cat = np.concatenate
        return cls((len(relations), rows, cols), rel,
                   cat([r.row_ids().astype(dt) for r in relations]),
                   cat([r.indices.astype(dt) for r in relations]), data)

    def relation_nnz(self) -> np.ndarray:
        """Non-zeros per relation (int64 [relations])."""
        return np.bincount(self.rel, minlength=self.shape[0]).astype(np.int64)

    def values(self) -> np.ndarray:
        """float64 values of the edges; ones for a pattern-only graph."""
        return np.ones(self.nnz) if self.data is None else self.data.astype(np.float64)

    def relation(self, r: int) -> CSR:
        """Relation ``r`` as a CSR (rows x cols)."""
        lo, hi = np.searchsorted(self.rel, [r, r + 1])
        rows, cols = self.shape[1:]
        dt = index_dtype(rows, cols, hi - lo)
        indptr = np.zeros(rows + 1, dt)
        np.cumsum(np.bincount(self.row[lo:hi], minlength=rows), out=indptr[1:])
        return CSR((rows, cols), indptr, self.col[lo:hi].astype(dt),
                   None if self.data is None else self.data[lo:hi])

    def union(self) -> CSR:
        """The pattern of all relations together (a pair in several relations counts once)."""
        _, rows, cols = self.shape
        key = self.row.astype(np.int64) * cols + self.col
        key = np.sort(key)
        key = key[np.concatenate(([True], key[1:] != key[:-1]))] if key.size else key
        dt = index_dtype(rows, cols, key.size)
        indptr = np.zeros(rows + 1, dt)
        np.cumsum(np.bincount(key // max(cols, 1), minlength=rows), out=indptr[1:])
        return CSR((rows, cols), indptr, (key % max(cols, 1)).astype(dt))

    def to_dense(self) -> np.ndarray:
        """float64 [relations, rows, cols] (small graphs: tests)."""
        out = np.zeros(self.shape)
        out[self.rel, self.row, self.col] = self.values()
        return out


def load_graph(path: str | Path) -> CSR:
    """Read a graph written by pitgen.graphs: scipy's save_npz or a plain np.savez
    with indptr/indices/shape (and optionally data); validated like every CSR. An unreadable
    or foreign file is a :class:`FileError`; scipy's other formats need scipy
    (:class:`DependencyError` without it)."""
    if not isinstance(path, (str, os.PathLike)):
        raise FileError(f"graph path must be a string or a path, got {type(path).__name__}")
    try:
        f = np.load(path, allow_pickle=False)
        if not isinstance(f, np.lib.npyio.NpzFile):
            raise FileError(f"cannot read graph {str(path)!r}: a single .npy array, not a "
                            f".npz graph")
        with f:
            keys = set(f.files)
            if "format" in keys and f["format"].item() not in (b"csr", "csr"):
                return CSR.from_scipy(_scipy_sparse(path).load_npz(path))
            missing = {"indptr", "indices", "shape"} - keys
            if missing:
                raise FileError(f"cannot read graph {str(path)!r}: not a CSR .npz, missing "
                                f"{sorted(missing)}")
            indptr, indices = _index_array(f["indptr"], "indptr"), _index_array(f["indices"], "indices")
            dt = np.promote_types(indptr.dtype, indices.dtype)
            data = f["data"] if "data" in keys else None
            return CSR(tuple(f["shape"]), indptr.astype(dt), indices.astype(dt), data)
    except OSError as e:
        raise FileError(f"cannot read graph {str(path)!r}: {e.strerror or e}") from None
    except (ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        if isinstance(e, PitgenError):
            raise
        raise FileError(f"cannot read graph {str(path)!r}: not a graph .npz "
                        f"({type(e).__name__}: {e})") from None


def _scipy_sparse(path: str | os.PathLike) -> Any:
    """scipy.sparse, which reading scipy's own .npz formats needs."""
    try:
        import scipy.sparse
    except ImportError:
        raise DependencyError(f"{path} is in scipy's sparse format, which needs scipy: "
                              f"pip install 'pitgen[graphs]'") from None
    return scipy.sparse


def check_dense_operand(name: str, x: np.ndarray, rows: int) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] != rows:
        raise ShapeError(f"{name} must be 2-D with {rows} rows, got shape {x.shape}")
    return x


@dataclass(frozen=True)
class ELL:
    """Every row padded to one width: ``cols`` [n_rows, width] padded with -1, ``vals`` with 0."""
    shape: tuple[int, int]
    cols: np.ndarray
    vals: np.ndarray

    @property
    def width(self) -> int:
        return int(self.cols.shape[1])

    @classmethod
    def from_csr(cls, csr: CSR, width: int | None = None) -> ELL:
        """Width None takes the longest row; a fixed width refuses rows that do not fit."""
        lengths = csr.row_lengths()
        longest = int(lengths.max(initial=0))
        w = longest if width is None else checks.integer(width, "ELL width", minimum=0)
        checks.allocation(csr.shape[0] * w, csr.indices.dtype.itemsize + 8, f"ELL of width {w}")
        if longest > w:
            row = int(np.flatnonzero(lengths > w)[0])
            raise ShapeError(f"ELL width {w} too small: row {row} has {lengths[row]} non-zeros")
        rows = csr.row_ids()
        slot = np.arange(csr.nnz) - csr.indptr[rows]
        cols = np.full((csr.shape[0], w), -1, csr.indices.dtype)
        vals = np.zeros((csr.shape[0], w))
        cols[rows, slot] = csr.indices
        vals[rows, slot] = csr.values()
        return cls(csr.shape, cols, vals)

    def to_dense(self) -> np.ndarray:
        out = np.zeros(self.shape)
        r, s = np.nonzero(self.cols >= 0)
        out[r, self.cols[r, s]] = self.vals[r, s]
        return out


@dataclass(frozen=True)
class BSR:
    """b x b blocks in block-CSR order; blocks on the right/bottom edge are zero-padded past the
    matrix. ``mask`` marks the structural non-zeros so explicit zeros survive (SDDMM needs the
    pattern, not just the values)."""
    shape: tuple[int, int]
    block: int
    indptr: np.ndarray
    indices: np.ndarray
    blocks: np.ndarray
    mask: np.ndarray

    @property
    def grid(self) -> tuple[int, int]:
        """Number of block rows and block columns (edge blocks included)."""
        b = self.block
        return -(-self.shape[0] // b), -(-self.shape[1] // b)

    def block_rows(self) -> np.ndarray:
        return np.repeat(np.arange(self.grid[0]), np.diff(self.indptr))

    @classmethod
    def from_csr(cls, csr: CSR, block: int) -> BSR:
        b = checks.integer(block, "BSR block size", maximum=2**31 - 1)
        nbr, nbc = -(-csr.shape[0] // b), -(-csr.shape[1] // b)
        rows, cols = csr.row_ids().astype(np.int64), csr.indices.astype(np.int64)
        keys, which = np.unique((rows // b) * nbc + cols // b, return_inverse=True)
        checks.allocation(keys.size * b * b, 9, f"BSR with {keys.size} blocks of {b}x{b}")
        dt = index_dtype(nbc, keys.size)
        indptr = np.zeros(nbr + 1, dt)
        np.cumsum(np.bincount(keys // nbc, minlength=nbr), out=indptr[1:])
        blocks = np.zeros((keys.size, b, b))
        mask = np.zeros((keys.size, b, b), bool)
        blocks[which, rows % b, cols % b] = csr.values()
        mask[which, rows % b, cols % b] = True
        return cls(csr.shape, b, indptr, (keys % nbc).astype(dt), blocks, mask)

    def to_dense(self) -> np.ndarray:
        (nbr, nbc), b = self.grid, self.block
        padded = np.zeros((nbr, b, nbc, b))
        padded[self.block_rows(), :, self.indices, :] = self.blocks
        return padded.reshape(nbr * b, nbc * b)[: self.shape[0], : self.shape[1]]


@dataclass(frozen=True)
class HybBucket:
    """One ELL bucket of a hyb matrix: rows of one column part, all padded to ``width``.

    ``row_ids`` maps each bucket row to its original row; ``needs_atomics`` says that another
    bucket row may write the same output row (several column parts, or a cut long row).
    """
    part: int
    width: int
    row_ids: np.ndarray
    cols: np.ndarray
    vals: np.ndarray
    needs_atomics: bool


@dataclass(frozen=True)
class Hyb:
    """SparseTIR's hyb(c, k): columns split into ``c`` parts; within each part a row goes to the
    narrowest bucket of width 1, 2, 4, ..., 2**k that holds it, and longer rows are cut into
    rows of width 2**k. Narrow buckets keep padding low on power-law graphs."""
    shape: tuple[int, int]
    c: int
    k: int
    buckets: list[HybBucket]

    @property
    def part_size(self) -> int:
        """Columns per part; the last part may be shorter."""
        return max(1, -(-self.shape[1] // self.c))

    @classmethod
    def from_csr(cls, csr: CSR, c: int, k: int) -> Hyb:
        c = checks.integer(c, "hyb's c (column parts)", maximum=2**31 - 1)
        k = checks.integer(k, "hyb's k (widest bucket 2**k)", minimum=0, maximum=HYB_MAX_K)
        n_rows = csr.shape[0]
        checks.allocation(n_rows * c, 24, f"hyb({c}, {k}) of {n_rows} rows")
        cap = 1 << k
        hyb = cls(csr.shape, c, k, [])
        rows = csr.row_ids().astype(np.int64)
        # Columns are sorted within a row, so each (row, part) group is contiguous in CSR order.
        key = rows * c + csr.indices // hyb.part_size
        count = np.bincount(key, minlength=n_rows * c)
        start = np.cumsum(count) - count
        pos = np.arange(csr.nnz) - start[key]
        groups = np.flatnonzero(count)
        g_count, g_row, g_part = count[groups], groups // c, groups % c
        g_exp = np.minimum(np.searchsorted(1 << np.arange(k + 1), g_count), k)
        g_pieces = -(-g_count // cap)
        order = np.lexsort((g_row, g_exp, g_part))
        pieces = g_pieces[order]
        # Bucket rows, globally numbered bucket by bucket (part-major, then width).
        g_first = np.empty(groups.size, np.int64)
        g_first[order] = np.cumsum(pieces) - pieces
        br_bucket = np.repeat((g_part * (k + 1) + g_exp)[order], pieces)
        br_row = np.repeat(g_row[order], pieces)
        br_cut = np.repeat((g_pieces > 1)[order], pieces)
        br_width = 1 << (br_bucket % (k + 1))
        br_offset = np.cumsum(br_width) - br_width
        group_of = np.zeros(n_rows * c, np.int64)
        group_of[groups] = np.arange(groups.size)
        slot = br_offset[g_first[group_of[key]] + pos // cap] + pos % cap
        flat_cols = np.full(int(br_width.sum()), -1, csr.indices.dtype)
        flat_vals = np.zeros(flat_cols.size)
        flat_cols[slot] = csr.indices
        flat_vals[slot] = csr.values()
        bucket_ids, first_row = np.unique(br_bucket, return_index=True)
        ends = np.append(first_row[1:], br_bucket.size)
        for b, lo, hi in zip(bucket_ids.tolist(), first_row.tolist(), ends.tolist()):
            width = 1 << (b % (k + 1))
            span = slice(int(br_offset[lo]), int(br_offset[lo]) + (hi - lo) * width)
            hyb.buckets.append(HybBucket(
                part=b // (k + 1), width=width,
                row_ids=br_row[lo:hi].astype(csr.indices.dtype),
                cols=flat_cols[span].reshape(hi - lo, width),
                vals=flat_vals[span].reshape(hi - lo, width),
                needs_atomics=bool(c > 1 or br_cut[lo:hi].any())))
        return hyb

    def write_plan(self) -> dict[str, np.ndarray]:
        """How the GPU SpMM may write each row (device_formats builds the same arrays on the
        GPU). Shared rows, those of buckets that need atomics, add into workspace rows
        ``ws_index[row]`` that a finish pass writes with the empty rows (``fix_rows``). With
        c == 1 the pieces of a cut row may instead store partial rows summed by the last piece:
        ``cut_index`` numbers the cut rows, ``cut_info`` holds (first bucket row, pieces, first
        partial row) per cut row, and the launch zeroes ``empty_rows``. Every other row has one
        bucket row, which stores it."""
        n_rows = self.shape[0]
        brows = np.zeros(n_rows, np.int64)   # bucket rows per row
        first = np.full(n_rows, -1, np.int64)
        shared = np.zeros(n_rows, bool)
        offset = 0
        for bk in self.buckets:
            ids = bk.row_ids.astype(np.int64)
            np.add.at(brows, ids, 1)
            shared[ids] |= bk.needs_atomics
            rows, at = np.unique(ids, return_index=True)   # each row's first bucket row here
            fresh = first[rows] < 0
            first[rows[fresh]] = offset + at[fresh]
            offset += ids.size
        cut = (brows > 1) if self.c == 1 else np.zeros(n_rows, bool)
        pieces = np.where(cut, brows, 0)
        base = np.cumsum(pieces) - pieces
        return {
            "ws_index": np.where(shared, np.cumsum(shared) - 1, -1),
            "fix_rows": np.flatnonzero(shared | (brows == 0)),
            "cut_index": np.where(cut, np.cumsum(cut) - 1, -1),
            "cut_info": np.stack([first, pieces, base], 1)[cut].reshape(-1, 3),
            "empty_rows": np.flatnonzero(brows == 0),
        }

    def to_dense(self) -> np.ndarray:
        """Sum of every bucket's contribution (cut rows and parts add up to the original)."""
        out = np.zeros(self.shape)
        for bk in self.buckets:
            r, s = np.nonzero(bk.cols >= 0)
            np.add.at(out, (bk.row_ids[r], bk.cols[r, s]), bk.vals[r, s])
        return out

    def stats(self) -> dict[str, Any]:
        """Padding ratio = padded slots (all slots of all buckets) / nnz; 1.0 means no padding."""
        slots = sum(bk.cols.size for bk in self.buckets)
        nnz = sum(int((bk.cols >= 0).sum()) for bk in self.buckets)
        return {
            "nnz": nnz,
            "slots": slots,
            "padding_ratio": slots / nnz if nnz else 1.0,
            "buckets": [{"part": bk.part, "width": bk.width, "rows": int(bk.row_ids.size),
                         "needs_atomics": bk.needs_atomics} for bk in self.buckets],
        }


# -- reference operators (float64) ------------------------------------------------------------


