"""Sparse formats on the GPU: CSR held as torch tensors, converted on the device to ELL, BSR and
SparseTIR's hyb(c, k), so that a changing graph or mask never falls back to the CPU.

Each conversion runs the kernels of templates/convert.cu.j2 (BSR with torch's scan between its
passes, hyb's scan in its first pass); each needs one host synchronisation to size its buffers
(ELL: the longest row; BSR: the number of blocks; hyb: the rows per bucket), except hyb sized
by bounds (``sync=False``), which needs none: a graph that changes every call
(``DeviceCSR.from_coo``, no sync either) converts without waiting. ``to_format`` keeps a
layout on its DeviceCSR while it is in use, and ``DeviceMatrix.with_values`` refills a layout
from new CSR-order values on the GPU. Every layout keeps ``perm`` (slot -> CSR position, -1 for
padding), so SDDMM results come back in CSR order. The NumPy references of every layout are in
pitgen/formats.py; ``DeviceMatrix.to_host`` returns the same objects, equal slot for slot.
``DeviceCSR.transpose`` builds Aᵀ on the GPU (no host sync) for SpMM's backward, kept with the
matrix.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import numpy as np

from .. import cache
from ..errors import DeviceError, PlanError, ShapeError
from ..limits import INT32_MAX
from ..operands import check_tensor, on_operand_device
from ..opspec import OpSpec, Permutation
from ..runtime import TorchLaunch, current_stream, stream_counters
from .formats import BSR, BSR_BLOCKS, CSR, ELL, FORMATS, SPMM_EXPR, Hyb, HybBucket

__all__ = ["DeviceCOO", "DeviceCSR", "DeviceMatrix", "DeviceTranspose", "to_format", "FORMATS",
           "VALUE_DTYPES", "TRANSPOSE_EXPR"]

VALUE_DTYPES = ("float32", "float16")
THREADS = 256
HYB_THREADS = 256   # rows per CTA of the hyb passes (HYB_THREADS in convert.cu.j2)
MAX_GRID = 1 << 20  # conversion kernels are grid-stride loops

#: CSR -> ELL / BSR / hyb on the device. The layouts reorder a matrix's rows (hyb's buckets)
#: and pad them, which SpMM's rules allow: rows are spatial, written back to their places.
CONVERT = OpSpec("convert", "convert.cu.j2", {
        "pit_csr_rows": "PiiP",
        "pit_dense_to_csr": "PiiPiPP",
        "pit_coo_keys": "PPiqiiPiP",
        "pit_coo_csr": "PiPPiqiiPPP",
        "pit_coo_count": "PPiqiiPP",
        "pit_coo_scatter": "PPiPiqiiPPPP",
        "pit_row_stats": "PiiP",
        "pit_to_ell": "PPPiiiiPPP",
        "pit_bsr_mark": "PPiiiiiP",
        "pit_bsr_fill": "PPPiiiiiiPiPPPPP",
        "pit_hyb_count": "PPiiiiiiPP",
        "pit_hyb_layout": "PPPiiiiiiPiiiiii" + "P" * 13,
    },
    (Permutation("rows", SPMM_EXPR, "spatial", "A"),), VALUE_DTYPES)


#: SpMM's backward dX = Aᵀ dY, read row by row from the transpose.
TRANSPOSE_EXPR = "DX[j,f] += A[i,j] * DY[i,f]"
#: CSR -> CSR of Aᵀ: count per column, scan, a stable sort by column (torch), place. The
#: transposed rows (j, spatial) are written in any order, each slot to its own place.
TRANSPOSE = OpSpec("graph transpose", "graph_transpose.cu.j2", {
        "pit_transpose_count": "PPiiiP",
        "pit_transpose_place": "PPPiiiPPPP",
    },
    (Permutation("transposed rows", TRANSPOSE_EXPR, "spatial", "A"),), VALUE_DTYPES)


def _torch():
    import torch
    return torch


def _convert_kernels(dtype: str, src_dtype: str | None = None):
    """The conversion module for these value / dense-source dtypes, loaded once per process."""
    return CONVERT.module({"dtype": dtype, "src_dtype": src_dtype or dtype})


def _grid(n: int, per_block: int = THREADS) -> tuple[int, int, int]:
    return (max(0, min(-(-n // per_block), MAX_GRID)), 1, 1)


def _launch(kernels: Any, name: str, n: int, *args: Any, per_block: int = THREADS) -> None:
    """Enqueue one grid-stride conversion kernel over n items on torch's current stream."""
    if n <= 0:
        return
    with TorchLaunch() as tl:
        kernels.launch(name, _grid(n, per_block), (THREADS, 1, 1), tl.stream,
                       *(a.data_ptr() if hasattr(a, "data_ptr") else a for a in args))


def _launch_ctas(kernels: Any, name: str, ctas: int, threads: int, *args: Any) -> None:
    """Enqueue a kernel of ``ctas`` blocks on torch's current stream."""
    with TorchLaunch() as tl:
        kernels.launch(name, (ctas, 1, 1), (threads, 1, 1), tl.stream,
                       *(a.data_ptr() if hasattr(a, "data_ptr") else a for a in args))


def _dtype_name(t: Any) -> str:
    return str(t.dtype).replace("torch.", "")


def _check_value_dtype(dtype: str) -> str:
    if dtype not in VALUE_DTYPES:
        raise ShapeError(f"value dtype {dtype!r} is not supported; use one of {VALUE_DTYPES}")
    return dtype


class DeviceCSR:
    """CSR on the GPU: int32 ``indptr`` [rows + 1] and ``indices`` [nnz], ``values`` [nnz]
    (float32 or float16). Treated as immutable: conversions and the transpose are cached on it;
    for new values on the same pattern use ``DeviceMatrix.with_values``. Kernels range-check
    every index, but only ``from_host`` / ``from_scipy`` validate sortedness and ranges.
    ``rows``: the int32 row of every non-zero when the caller has it (``row_ids`` then needs no
    launch). ``sorted_columns``: whether columns ascend within each row (every constructor but
    ``from_coo(sort=False)`` promises it; hyb with c > 1 relies on it)."""

    def __init__(self, shape: tuple[int, int], indptr: Any, indices: Any, values: Any, *,
                 rows: Any = None, sorted_columns: bool = True):
        if len(shape) != 2 or min(int(s) for s in shape) < 0:
            raise ShapeError(f"DeviceCSR shape must be two non-negative extents, got {shape}")
        self.shape = (int(shape[0]), int(shape[1]))
        if max(self.shape) > INT32_MAX:
            raise ShapeError(f"DeviceCSR shape {self.shape} exceeds int32 indexing")
        self.indptr = check_tensor("indptr", indptr, ("int32",), 1, (self.shape[0] + 1,))
        self.indices = check_tensor("indices", indices, ("int32",), 1)
        self.values = check_tensor("values", values, VALUE_DTYPES, 1, (self.indices.shape[0],))
        if not (indptr.device == indices.device == values.device):
            raise ShapeError(f"DeviceCSR tensors on different devices: {indptr.device}, "
                             f"{indices.device}, {values.device}")
        # converted layouts, weakly: a layout holds its DeviceCSR, so a strong cache would be
        # a reference cycle whose GPU memory waits for the garbage collector (a graph that
        # changes every call would pile them up); a layout lives while someone uses it
        self._formats: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        # the "csr" view's launch closures and counters, kept here: views are made per call
        self._csr_launches: dict = {}
        self._csr_counters: dict = {}
        self._rows = None if rows is None else \
            check_tensor("rows", rows, ("int32",), 1, (self.indices.shape[0],))
        self._transposed: DeviceTranspose | None = None
        self.sorted_columns = sorted_columns

    @property
    def nnz(self) -> int:
        return int(self.indices.shape[0])

    @property
    def dtype(self) -> str:
        return _dtype_name(self.values)

    @property
    def device(self) -> Any:
        """The torch device its tensors are on (operators on it run there)."""
        return self.indptr.device

    @classmethod
    def from_host(cls, csr: CSR, dtype: str = "float32") -> DeviceCSR:
        """Validate ``csr`` on the host (CSR.validate: monotone indptr, sorted unique in-range
        columns, one index dtype; plus int32 range), then upload it."""
        torch = _torch()
        _check_value_dtype(dtype)
        if not isinstance(csr, CSR):
            raise ShapeError(f"from_host needs a pitgen.graph.formats.CSR, got {type(csr).__name__}")
        csr.validate()
        if csr.nnz > INT32_MAX or max(csr.shape) > INT32_MAX:
            raise ShapeError(f"CSR with shape {csr.shape} and nnz {csr.nnz} exceeds int32 indexing")

        def up(a: np.ndarray, dt: Any) -> Any:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device="cuda", dtype=dt)
        return cls(csr.shape, up(csr.indptr.astype(np.int32), torch.int32),
                   up(csr.indices.astype(np.int32), torch.int32),
                   up(csr.values().astype(dtype), getattr(torch, dtype)))  # rounded once

    @classmethod
    def from_scipy(cls, m: Any, dtype: str = "float32") -> DeviceCSR:
        """Any scipy sparse matrix (duplicates summed, columns sorted) through ``from_host``."""
        return cls.from_host(CSR.from_scipy(m), dtype)

    @classmethod
    @on_operand_device
    def from_coo(cls, shape: tuple[int, int], rows: Any, cols: Any, values: Any = None, *,
                 dtype: str | None = None, check: bool = True, sort: bool = True) -> DeviceCSR:
        """A CSR from an edge list on the GPU (a graph that changes every step): ``rows`` and
        ``cols`` int32/int64 CUDA tensors [nnz], ``values`` [nnz] (None: ones of ``dtype``,
        default float32). Duplicate edges are kept and add up, as in an uncoalesced torch COO.
        ``check`` refuses an edge out of range (``ShapeError`` naming it) at the cost of one
        host sync; without it nothing synchronises and such edges are dropped (placed past the
        last row).

        ``sort=True``: one radix sort of (row, col) keys, so columns ascend within each row and
        the result is the same on every run. ``sort=False``: a counting pass per row and a
        scatter (atomics; no sort, several times cheaper on large graphs): each row's columns
        come in any order, which SpMM allows (its reduction axis j is permutation invariant),
        and its float sums may then differ from run to run in the last bits. Such a CSR has
        ``sorted_columns`` False; layouts that split rows by column (hyb with c > 1) refuse
        it."""
        torch = _torch()
        (n_rows, n_cols), rows, cols, values, dtype = _edge_list("from_coo", shape, rows, cols,
                                                                 values, dtype)
        nnz = int(rows.shape[0])
        dev = rows.device
        k = _convert_kernels(dtype)
        is64 = int(rows.dtype == torch.int64)
        bad = torch.full((1,), nnz, dtype=torch.int32, device=dev) if check and nnz else None
        vals = torch.empty(nnz, dtype=getattr(torch, dtype), device=dev)
        indices = torch.empty(nnz, dtype=torch.int32, device=dev)
        has_values = int(values is not None)
        if sort:
            key64 = n_rows * n_cols > INT32_MAX   # int32 keys sort in half the radix passes
            key = torch.empty(nnz, dtype=torch.int64 if key64 else torch.int32, device=dev)
            _launch(k, "pit_coo_keys", nnz, rows, cols, is64, nnz, n_rows, n_cols, key,
                    int(key64), 0 if bad is None else bad)
        else:   # per-row counts, then (after the scan) per-row fill counters and the dropped
            counts = torch.zeros(2 * n_rows + 1, dtype=torch.int32, device=dev)
            _launch(k, "pit_coo_count", nnz, rows, cols, is64, nnz, n_rows, n_cols, counts,
                    0 if bad is None else bad)
        if bad is not None and int(bad) < nnz:   # the optional sync
            at = int(bad)
            raise ShapeError(f"edge {at} = ({int(rows[at])}, {int(cols[at])}) is outside the "
                             f"{n_rows} x {n_cols} matrix")
        if sort:
            skey, order = torch.sort(key, stable=True)
            indptr = torch.zeros(n_rows + 1, dtype=torch.int32, device=dev) if not nnz else \
                torch.empty(n_rows + 1, dtype=torch.int32, device=dev)
            _launch(k, "pit_coo_csr", nnz, skey, int(key64), order, values if has_values else 0,
                    has_values, nnz, n_rows, n_cols, indptr, indices, vals)
            return cls((n_rows, n_cols), indptr, indices, vals)
        indptr = torch.zeros(n_rows + 1, dtype=torch.int32, device=dev)
        if n_rows:
            torch.cumsum(counts[:n_rows], 0, dtype=torch.int32, out=indptr[1:])
        _launch(k, "pit_coo_scatter", nnz, rows, cols, is64, values if has_values else 0,
                has_values, nnz, n_rows, n_cols, indptr, counts[n_rows:], indices, vals)
        return cls((n_rows, n_cols), indptr, indices, vals, sorted_columns=False)

    @classmethod
    @on_operand_device
    def from_dense(cls, t: Any, dtype: str | None = None) -> DeviceCSR:
        """A 2-D CUDA tensor's non-zeros, found on the GPU: a bool/uint8 mask gives values 1, a
        float16/float32 tensor its values. Synchronises with the host once (to read nnz)."""
        torch = _torch()
        check_tensor("dense", t, ("bool", "uint8", "float16", "float32"), 2, contiguous=False)
        src = _dtype_name(t)
        dtype = _check_value_dtype(dtype or (src if src in VALUE_DTYPES else "float32"))
        t = t.contiguous()
        n_rows, n_cols = t.shape
        if max(n_rows, n_cols) > INT32_MAX:
            raise ShapeError(f"dense shape {tuple(t.shape)} exceeds int32 indexing")
        counts = (t != 0).sum(1)
        ptr64 = torch.zeros(n_rows + 1, dtype=torch.int64, device=t.device)
        torch.cumsum(counts, 0, out=ptr64[1:])
        nnz = int(ptr64[-1])  # the one host synchronisation: sizes indices and values
        if nnz > INT32_MAX:
            raise ShapeError(f"dense operand has {nnz} non-zeros, more than int32 indexing allows")
        indptr = ptr64.to(torch.int32)
        indices = torch.empty(nnz, dtype=torch.int32, device=t.device)
        values = torch.empty(nnz, dtype=getattr(torch, dtype), device=t.device)
        src_t = t.view(torch.uint8) if src == "bool" else t
        k = _convert_kernels(dtype, "uint8" if src in ("bool", "uint8") else src)
        _launch(k, "pit_dense_to_csr", n_rows * 32, src_t, n_rows, n_cols, indptr, nnz, indices,
                values)
        return cls((n_rows, n_cols), indptr, indices, values)

    def release(self) -> None:
        """Drop the cached conversions and the transpose (which references this matrix back),
        so their GPU memory goes as soon as nothing else holds them."""
        self._formats.clear()
        t, self._transposed = self._transposed, None
        if t is not None and t.csr._transposed is not None and t.csr._transposed.csr is self:
            t.csr._transposed = None

    @on_operand_device
    def row_ids(self) -> Any:
        """int32 row of every non-zero (built on the GPU once, no sync)."""
        if self._rows is None:
            torch = _torch()
            self._rows = torch.empty(self.nnz, dtype=torch.int32, device=self.indices.device)
            _launch(_convert_kernels(self.dtype), "pit_csr_rows", self.nnz, self.indptr,
                    self.shape[0], self.nnz, self._rows)
        return self._rows

    @on_operand_device
    def transpose(self) -> DeviceTranspose:
        """Aᵀ on the GPU, built once and kept (no host sync): count per column, scan, a stable
        sort of the entries by column, place (templates/graph_transpose.cu.j2). Its rows
        ascend within each transposed row (canonical CSR, like ``from_host``'s); its values are
        ``values[perm]`` as they were when it was built."""
        if self._transposed is None:
            torch = _torch()
            n_rows, n_cols = self.shape
            dev = self.indices.device
            i32 = {"dtype": torch.int32, "device": dev}
            k = TRANSPOSE.module({})
            rows = self.row_ids()
            counts = torch.zeros(n_cols, **i32)
            _launch(k, "pit_transpose_count", self.nnz, rows, self.indices, self.nnz, n_rows,
                    n_cols, counts)
            t_indptr = torch.zeros(n_cols + 1, **i32)
            if n_cols:
                torch.cumsum(counts, 0, dtype=torch.int32, out=t_indptr[1:])
            valid = (self.indices >= 0) & (self.indices < n_cols) & (rows >= 0)
            key = torch.where(valid, self.indices, n_cols)   # out-of-range entries last
            order = torch.sort(key, stable=True).indices     # radix sort: rows stay ascending
            t_indices = torch.zeros(self.nnz, **i32)
            perm = torch.zeros(self.nnz, **i32)
            inverse = torch.full((self.nnz,), -1, **i32)
            _launch(k, "pit_transpose_place", self.nnz, order, rows, self.indices, self.nnz,
                    n_rows, n_cols, t_indptr, t_indices, perm, inverse)
            t = DeviceCSR((n_cols, n_rows), t_indptr, t_indices, self.values.index_select(0, perm))
            self._transposed = DeviceTranspose(t, perm, inverse)
            t._transposed = DeviceTranspose(self, inverse, perm)
        return self._transposed

    @on_operand_device
    def row_stats(self) -> dict[str, float]:
        """Host numbers describing the rows (the tuner's cache key): rows, cols, nnz, mean /
        max / std (population) row length, fraction of empty rows. One kernel; synchronises
        once."""
        torch = _torch()
        n_rows, n_cols = self.shape
        if n_rows == 0:
            return {"rows": 0, "cols": n_cols, "nnz": 0, "mean_row": 0.0, "max_row": 0,
                    "std_row": 0.0, "empty_fraction": 0.0}
        out = torch.zeros(4, dtype=torch.int64, device=self.indptr.device)
        _launch(_convert_kernels(self.dtype), "pit_row_stats", n_rows, self.indptr, n_rows,
                self.nnz, out)
        total, squares, longest, empty = out.tolist()   # the one sync
        mean = total / n_rows
        return {"rows": n_rows, "cols": n_cols, "nnz": self.nnz, "mean_row": mean,
                "max_row": int(longest),
                "std_row": max(squares / n_rows - mean * mean, 0.0) ** 0.5,
                "empty_fraction": empty / n_rows}

    def to_torch(self) -> Any:
        """The same matrix as a torch.sparse_csr_tensor (shares the buffers)."""
        return _torch().sparse_csr_tensor(self.indptr, self.indices, self.values, size=self.shape)


def _edge_list(what: str, shape: tuple[int, int], rows: Any, cols: Any, values: Any,
               dtype: str | None) -> tuple[tuple[int, int], Any, Any, Any, str]:
    """An edge list's (shape, rows, cols, values, value dtype), validated: int32/int64 CUDA
    index tensors [nnz] of one dtype on one device, values [nnz] float32/float16 or None (then
    ``dtype``, default float32), extents and nnz in int32 range."""
    if len(shape) != 2 or min(int(e) for e in shape) < 0 or max(int(e) for e in shape) > INT32_MAX:
        raise ShapeError(f"{what} shape {shape} is not two extents in int32 range")
    rows = check_tensor("rows", rows, ("int32", "int64"), 1)
    cols = check_tensor("cols", cols, (_dtype_name(rows),), 1, (rows.shape[0],))
    if values is not None:
        values = check_tensor("values", values, VALUE_DTYPES, 1, (rows.shape[0],))
        if dtype is not None and _dtype_name(values) != _check_value_dtype(dtype):
            raise ShapeError(f"values are {_dtype_name(values)} but dtype={dtype!r}")
        dtype = _dtype_name(values)
    dtype = _check_value_dtype(dtype or "float32")
    if not (rows.device == cols.device and (values is None or values.device == rows.device)):
        raise DeviceError(f"{what} tensors on different devices: rows on {rows.device}, "
                          f"cols on {cols.device}"
                          + ("" if values is None else f", values on {values.device}"))
    if rows.shape[0] > INT32_MAX:
        raise ShapeError(f"{rows.shape[0]} edges exceed int32 indexing")
    return (int(shape[0]), int(shape[1])), rows, cols, values, dtype


class DeviceCOO:
    """An edge list on the GPU as it comes: a graph that changes every call (sampled
    neighbours, DropEdge), for SpMM to multiply without building a CSR first. ``rows`` and
    ``cols``: int32 or int64 CUDA tensors [nnz]; ``values`` [nnz] float32/float16, or None
    (ones of ``dtype``, default float32). Duplicate edges add up; an edge outside the matrix
    is skipped by every kernel. The tensors are held, not copied, and nothing synchronises.

    SpMM runs it directly (``pitgen.graph.kernels.spmm_coo``: atomic adds, one launch) or, where
    that costs more (``pitgen.graph.model.coo_pays``), through ``to_csr`` and a format."""

    def __init__(self, shape: tuple[int, int], rows: Any, cols: Any, values: Any = None, *,
                 dtype: str | None = None):
        self.shape, self.rows, self.cols, self.values, self.dtype = _edge_list(
            "DeviceCOO", shape, rows, cols, values, dtype)

    @property
    def nnz(self) -> int:
        return int(self.rows.shape[0])

    @property
    def device(self) -> Any:
        """The torch device its tensors are on (operators on it run there)."""
        return self.rows.device

    def to_csr(self, sort: bool = False) -> DeviceCSR:
        """The same matrix as a DeviceCSR (``DeviceCSR.from_coo`` without its checking sync:
        edges outside the matrix are dropped); ``sort`` as there."""
        return DeviceCSR.from_coo(self.shape, self.rows, self.cols, self.values,
                                  dtype=self.dtype, check=False, sort=sort)


@dataclass(eq=False)
class DeviceTranspose:
    """Aᵀ of a DeviceCSR: ``csr`` (shape [cols, rows]), ``perm`` [nnz] int32: the position in
    A's CSR order of each entry of ``csr`` (so Aᵀ's values are ``A.values[perm]``), and
    ``inverse`` [nnz]: the position in ``csr`` of each entry of A (-1 for an entry with an
    out-of-range index, which Aᵀ leaves out)."""
    csr: DeviceCSR
    perm: Any
    inverse: Any


@dataclass
class DeviceMatrix:
    """One format of a DeviceCSR on the GPU: ``buffers`` by name (see docs/formats.md),
    ``params`` as resolved (e.g. the ELL width chosen), ``info`` host numbers of the layout."""
    fmt: str
    params: dict[str, Any]
    shape: tuple[int, int]
    nnz: int
    dtype: str
    buffers: dict[str, Any]
    source: DeviceCSR
    info: dict[str, Any] = field(default_factory=dict)
    #: per torch stream: hyb (c == 1) cut-row counters that SpMM launches on it share
    counters: dict[int, Any] = field(default_factory=dict, repr=False, compare=False)
    #: SpMM launch closures of this layout's buffers by call signature (kernels.spmm)
    launches: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def device(self) -> Any:
        """The torch device its buffers are on (its source's)."""
        return self.source.device

    @on_operand_device
    def with_values(self, values: Any) -> DeviceMatrix:
        """The same layout filled from new CSR-order values [nnz] on the GPU (no sync)."""
        torch = _torch()
        check_tensor("values", values, (self.dtype,), 1, (self.nnz,))
        src = DeviceCSR(self.shape, self.source.indptr, self.source.indices, values,
                        sorted_columns=self.source.sorted_columns)
        src._rows = self.source._rows
        bufs = dict(self.buffers)
        if self.fmt == "csr":
            bufs["values"] = values
        else:
            perm = bufs["perm"]
            key = "blocks" if self.fmt == "bsr" else "vals"
            if self.nnz == 0:
                bufs[key] = torch.zeros_like(bufs[key])
            else:
                bufs[key] = torch.where(perm >= 0, values[perm.clamp(min=0).long()],
                                        torch.zeros((), dtype=values.dtype, device=values.device))
        return DeviceMatrix(self.fmt, dict(self.params), self.shape, self.nnz, self.dtype, bufs,
                            src, dict(self.info))

    @on_operand_device
    def exact(self) -> DeviceMatrix:
        """This layout with exact host numbers. A hyb layout sized by bounds (``to_format(...,
        sync=False)``) reads its table (one sync) and comes back with its buffers trimmed to
        the live rows and slots; any other layout is itself."""
        if self.info.get("exact", True):
            return self
        c, k = self.params["c"], self.params["k"]
        nb = c * (k + 1)
        t = self.buffers["table"].tolist()
        info = hyb_info(c, k, self.nnz, t[:nb], *t[3 * nb:3 * nb + 5], bool(t[3 * nb + 5]))
        live = {"brow_row": info["brows"], "cols": info["slots"], "vals": info["slots"],
                "perm": info["slots"], "slot_row": info["slots"], "fix_rows": info["fix_rows"],
                "cut_info": info["cut_rows"], "empty_rows": info["empty_rows"]}
        b = {name: buf[:live[name]] if name in live else buf for name, buf in self.buffers.items()}
        return DeviceMatrix(self.fmt, dict(self.params), self.shape, self.nnz, self.dtype, b,
                            self.source, info)

    def to_host(self) -> CSR | ELL | BSR | Hyb:
        """The layout as the NumPy format object of pitgen.graph.formats (float64 values): equal,
        slot for slot, to that format's reference conversion of the same CSR. Synchronises."""
        if not self.info.get("exact", True):
            return self.exact().to_host()
        b = {name: t.cpu().numpy() for name, t in self.buffers.items()}
        if self.fmt == "csr":
            return CSR(self.shape, b["indptr"], b["indices"], b["values"].astype(np.float64))
        if self.fmt == "ell":
            return ELL(self.shape, b["cols"], b["vals"].astype(np.float64))
        if self.fmt == "bsr":
            return BSR(self.shape, self.params["block"], b["indptr"], b["bcols"],
                       b["blocks"].astype(np.float64), b["perm"] >= 0)
        c, k = self.params["c"], self.params["k"]
        out = Hyb(self.shape, c, k, [])
        for bk, (rows, width) in enumerate(zip(self.info["bucket_rows"], self.info["widths"])):
            if rows == 0:
                continue
            r0 = self.info["row_offsets"][bk]
            s0 = self.info["slot_offsets"][bk]
            span = slice(s0, s0 + rows * width)
            out.buckets.append(HybBucket(
                part=bk // (k + 1), width=width, row_ids=b["brow_row"][r0:r0 + rows],
                cols=b["cols"][span].reshape(rows, width),
                vals=b["vals"][span].reshape(rows, width).astype(np.float64),
                needs_atomics=self.info["atomic"][bk]))
        return out

    @on_operand_device
    def to_dense(self) -> Any:
        """Dense torch tensor (float32) rebuilt from this layout's own buffers (tests)."""
        if not self.info.get("exact", True):
            return self.exact().to_dense()
        torch = _torch()
        dev = self.source.indices.device
        dense = torch.zeros(self.shape, dtype=torch.float32, device=dev)
        b = self.buffers
        if self.fmt == "csr":
            rows, cols, vals = self.source.row_ids(), b["indices"], b["values"]
        elif self.fmt == "ell":
            w = b["cols"].shape[1] if b["cols"].dim() == 2 else 0
            rows = torch.arange(self.shape[0], device=dev).repeat_interleave(w)
            cols, vals = b["cols"].reshape(-1), b["vals"].reshape(-1)
        elif self.fmt == "bsr":
            bs = self.params["block"]
            i = torch.arange(bs, device=dev)
            rows = (b["brows"][:, None, None] * bs + i[None, :, None]).expand(-1, bs, bs)
            cols = (b["bcols"][:, None, None] * bs + i[None, None, :]).expand(-1, bs, bs)
            live = b["perm"] >= 0
            rows, cols, vals = rows[live], cols[live], b["blocks"][live]
        else:
            widths = torch.tensor(self.info["widths"], device=dev)
            per_brow = widths.repeat_interleave(
                torch.tensor(self.info["bucket_rows"], device=dev))
            rows = b["brow_row"].long().repeat_interleave(per_brow)
            cols, vals = b["cols"], b["vals"]
        live = cols >= 0
        dense.index_put_((rows[live].long(), cols[live].long()), vals[live].float(),
                         accumulate=True)
        return dense


def _check_params(fmt: str, params: dict[str, Any], allowed: tuple[str, ...]) -> None:
    extra = sorted(set(params) - set(allowed))
    if extra:
        raise PlanError(f"format {fmt!r} takes {list(allowed) or 'no'} parameters, got {extra}")


@on_operand_device
def to_format(csr: DeviceCSR, fmt: str, *, sync: bool = True, **params: Any) -> DeviceMatrix:
    """Convert ``csr`` on the GPU: "csr" (a view, no sync), "ell" (width=None: the longest
    row), "bsr" (block in 8/16/32), "hyb" (c in 1..8 column parts, k in 0..6: bucket widths
    1..2^k). One host sync per conversion, which sizes the layout; hyb with ``sync=False``
    sizes it by bounds instead and never waits (``DeviceMatrix.exact`` reads its numbers
    later). A conversion is found again on ``csr`` by (fmt, params, sync) while something holds
    it (the cache is weak, so a graph that changes every call frees each layout when dropped,
    without waiting for the garbage collector)."""
    if not isinstance(csr, DeviceCSR):
        raise ShapeError(f"to_format needs a DeviceCSR, got {type(csr).__name__}")
    if fmt not in FORMATS:
        raise PlanError(f"unknown sparse format {fmt!r}; choose from {FORMATS}")
    if not isinstance(sync, bool) or (not sync and fmt not in ("csr", "hyb")):
        raise PlanError(f"sync=False is for csr and hyb (ELL and BSR are sized by the host), "
                        f"got sync={sync!r} for {fmt!r}")
    key = (fmt, tuple(sorted(params.items())), sync)
    hit = csr._formats.get(key)
    if hit is not None:
        return hit
    if fmt == "csr":   # a view (not cached: it would hold csr); its launches are csr's
        _check_params(fmt, params, ())
        return DeviceMatrix("csr", {}, csr.shape, csr.nnz, csr.dtype,
                            {"indptr": csr.indptr, "indices": csr.indices,
                             "values": csr.values, "rows": csr.row_ids()}, csr,
                            counters=csr._csr_counters, launches=csr._csr_launches)
    elif fmt == "ell":
        _check_params(fmt, params, ("width",))
        m = _to_ell(csr, params.get("width"))
    elif fmt == "bsr":
        _check_params(fmt, params, ("block",))
        block = params.get("block", 16)
        if block not in BSR_BLOCKS:
            raise PlanError(f"BSR block must be one of {BSR_BLOCKS}, got {block!r}")
        m = _to_bsr(csr, int(block))
    else:
        _check_params(fmt, params, ("c", "k"))
        c, k = params.get("c", 1), params.get("k", 4)
        if not (isinstance(c, int) and 1 <= c <= 8 and isinstance(k, int) and 0 <= k <= 6):
            raise PlanError(f"hyb needs integer c in 1..8 and k in 0..6, got c={c!r}, k={k!r}")
        if c > 1 and not csr.sorted_columns:
            raise PlanError(f"hyb with c={c} column parts needs each row's columns in order; "
                            "this CSR has them in any order (from_coo(sort=False)): use c=1 "
                            "or build it with sort=True")
        m = _to_hyb(csr, c, k) if sync else hyb_layout(csr, c, k, hyb_counts(csr, c, k), None)
    csr._formats[key] = m
    return m


def _to_ell(csr: DeviceCSR, width: int | None) -> DeviceMatrix:
    torch = _torch()
    n_rows, n_cols = csr.shape
    dev = csr.indices.device
    longest = max(0, int((csr.indptr[1:] - csr.indptr[:-1]).max())) if n_rows else 0  # 1 sync
    if width is not None and (not isinstance(width, int) or width < 0):
        raise PlanError(f"ELL width must be a non-negative integer, got {width!r}")
    w = longest if width is None else width
    if longest > w:
        raise ShapeError(f"ELL width {w} too small: the longest row has {longest} non-zeros")
    if n_rows * w > INT32_MAX:
        raise ShapeError(f"ELL of {n_rows} rows x width {w} exceeds int32 indexing")
    cols = torch.empty((n_rows, w), dtype=torch.int32, device=dev)
    vals = torch.empty((n_rows, w), dtype=csr.values.dtype, device=dev)
    perm = torch.empty((n_rows, w), dtype=torch.int32, device=dev)
    _launch(_convert_kernels(csr.dtype), "pit_to_ell", n_rows * w, csr.indptr, csr.indices,
            csr.values, n_rows, n_cols, csr.nnz, w, cols, vals, perm)
    return DeviceMatrix("ell", {"width": w}, csr.shape, csr.nnz, csr.dtype,
                        {"cols": cols, "vals": vals, "perm": perm}, csr,
                        {"width": w, "slots": n_rows * w,
                         "padding_ratio": n_rows * w / csr.nnz if csr.nnz else 1.0})


def _to_bsr(csr: DeviceCSR, b: int) -> DeviceMatrix:
    torch = _torch()
    n_rows, n_cols = csr.shape
    dev = csr.indices.device
    nbr, nbc = -(-n_rows // b), -(-n_cols // b)
    if nbr * nbc > INT32_MAX:
        raise ShapeError(f"BSR grid {nbr} x {nbc} blocks exceeds int32 indexing")
    k = _convert_kernels(csr.dtype)
    flags = torch.zeros(nbr * nbc, dtype=torch.int32, device=dev)
    _launch(k, "pit_bsr_mark", csr.nnz, csr.indptr, csr.indices, n_rows, n_cols, csr.nnz, b, nbc,
            flags)
    scan = torch.cumsum(flags, 0, dtype=torch.int32)
    nblk = int(scan[-1]) if scan.numel() else 0  # the one sync: sizes the blocks
    # every block holds an entry, which writes its coordinates: no fill needed for those
    indptr, bcols, brows = torch.empty(nbr + 1 + 2 * nblk, dtype=torch.int32,
                                       device=dev).split([nbr + 1, nblk, nblk])
    blocks = torch.zeros((nblk, b, b), dtype=csr.values.dtype, device=dev)
    perm = torch.full((nblk, b, b), -1, dtype=torch.int32, device=dev)
    _launch(k, "pit_bsr_fill", max(csr.nnz, nbr + 1), csr.indptr, csr.indices, csr.values,
            n_rows, n_cols, csr.nnz, b, nbr, nbc, scan, nblk, indptr, bcols, brows, blocks, perm)
    return DeviceMatrix("bsr", {"block": b}, csr.shape, csr.nnz, csr.dtype,
                        {"indptr": indptr, "bcols": bcols, "brows": brows, "blocks": blocks,
                         "perm": perm}, csr,
                        {"block": b, "blocks": nblk, "slots": nblk * b * b,
                         "padding_ratio": nblk * b * b / csr.nnz if csr.nnz else 1.0})


def hyb_atomic(c: int, k: int, width: int, any_cut: bool) -> bool:
    """Whether a hyb bucket's rows may share an output row: several column parts, or the
    widest bucket when some row was cut into pieces of width 2^k."""
    return c > 1 or (width == 1 << k and any_cut)


def _to_hyb(csr: DeviceCSR, c: int, k: int) -> DeviceMatrix:
    """Bucket rows ordered part-major, then by width, then by row (pitgen.graph.formats.Hyb's
    order), in two launches: per-CTA counts of bucket rows and of the write plan's row kinds,
    scanned over CTAs by the same pass's last CTA; the one sync (the totals size every
    buffer); then one grid that ranks every row within its row group (table, write plan,
    padding), each CTA claiming groups until none is left, waits until all are ranked, and
    places each entry.

    How SpMM may write each row (Hyb.write_plan states it in NumPy; SpMM's "cut" schedule picks
    for c == 1): shared rows, those of buckets whose writes collide (every non-empty row when
    c > 1; the widest bucket's rows when some row is cut, c == 1), add into an fp32 workspace
    row ws_index[row] that a finish pass writes with the empty rows (fix_rows). With c == 1 the
    pieces of a cut row may instead store partial rows (cut_info[cut_index[row]] = first bucket
    row, pieces, first partial row) that the last piece sums, the empty rows zeroed in the same
    launch. Every other row has one bucket row, which stores it."""
    scan = hyb_counts(csr, c, k)
    totals = scan[:, -1].tolist() if scan is not None else [0] * (c * (k + 1) + 4)  # one sync
    return hyb_layout(csr, c, k, scan, totals)


#: device index -> runtime.stream_counters cache of the hyb passes' counters: pass 1's done
#: counter, then those of passes 2 and 3: groups ranked, CTAs finished, groups claimed
_HYB_DONE = cache.memo("graph.hyb_done")


def _hyb_counters(dev: Any) -> Any:
    """The hyb passes' counters (_HYB_DONE's four words) on torch's current stream."""
    return stream_counters(_HYB_DONE.setdefault(dev.index, {}), current_stream(), 4, dev)


def hyb_counts(csr: DeviceCSR, c: int, k: int) -> Any:
    """hyb pass 1 with its scan: per CTA of HYB_THREADS rows, its bucket rows per bucket and
    its four row counts, as an inclusive scan over CTAs [c * (k + 1) + 4, CTAs] (None without
    rows), formed by the pass's last CTA (torch's cumsum was a launch of its own). Its last
    column holds the totals that size the layout. No sync."""
    torch = _torch()
    n_rows, n_cols = csr.shape
    n_counters = c * (k + 1) + 4
    if n_rows * c > INT32_MAX:
        raise ShapeError(f"hyb with {n_rows} rows x {c} parts exceeds int32 indexing")
    n_ctas = -(-n_rows // HYB_THREADS)
    if not n_ctas:
        return None
    dev = csr.indices.device
    hist = torch.empty(n_counters, n_ctas, dtype=torch.int32, device=dev)
    done = _hyb_counters(dev)
    _launch_ctas(_convert_kernels(csr.dtype), "pit_hyb_count", n_ctas, HYB_THREADS, csr.indptr,
                 csr.indices, n_rows, n_cols, csr.nnz, c, k, max(1, -(-n_cols // c)), hist,
                 done)
    return hist


#: The row counts pit_hyb_layout writes after the three per-bucket columns of a hyb table:
#: workspace rows, cut rows, partial rows, empty rows, fix rows, and whether a group was cut.
HYB_TABLE_COUNTS = 6


def hyb_layout(csr: DeviceCSR, c: int, k: int, scan: Any,
               totals: list[int] | None) -> DeviceMatrix:
    """hyb passes 2 and 3: the buffers, then one launch that ranks the rows and writes the table,
    the write plan and the padding, waits until every row group is ranked and places every
    entry; no sync. ``totals`` (the host copy of ``scan``'s last column) sizes them exactly;
    None sizes them by bounds instead (a bucket row holds an entry, so rows <= nnz; a group of
    n entries pads to < 2n slots): the padding past the live slots reads as padding, SpMM takes
    the live counts from the table, and ``info`` holds the bounds until
    :meth:`DeviceMatrix.exact` reads the table."""
    torch = _torch()
    n_rows, n_cols = csr.shape
    dev = csr.indices.device
    nb, nnz = c * (k + 1), csr.nnz
    n_ctas = -(-n_rows // HYB_THREADS)
    if totals is not None:
        info = hyb_info(c, k, nnz, totals[:nb], *hyb_counts_of(c, totals[nb:]))
        if info["slots"] > INT32_MAX:
            raise ShapeError(f"hyb layout of {info['slots']} slots exceeds int32 indexing")
    else:
        if 2 * nnz > INT32_MAX:
            raise ShapeError(f"a hyb layout sized by bounds for {nnz} non-zeros exceeds int32 "
                             "indexing")
        info = hyb_bounds(c, k, n_rows, nnz)
    n_brows, n_slots, n_empty = info["brows"], info["slots"], info["empty_rows"]
    n_cut, n_fix = info["cut_rows"], info["fix_rows"]
    # int32 buffers as views of one allocation, each 16-byte aligned
    names = ("table", "brow_row", "cols", "perm", "slot_row", "ws_index", "fix_rows",
             "cut_index", "cut_info", "empty_rows", "meta")
    sizes = (3 * nb + HYB_TABLE_COUNTS, n_brows, n_slots, n_slots, n_slots, n_rows, n_fix,
             n_rows, 3 * n_cut, n_empty, 3 * n_rows * c)
    parts = [m for n in sizes for m in (n, -n % 4)]   # each buffer, then its padding
    arena = torch.empty(sum(parts), dtype=torch.int32, device=dev)
    b = dict(zip(names, arena.split(parts)[::2]))
    meta = b.pop("meta")   # each group's (first bucket row, CSR start, size): pass 3's input
    b["vals"] = torch.empty(n_slots, dtype=csr.values.dtype, device=dev)
    b["cut_info"] = b["cut_info"].view(n_cut, 3)
    if n_ctas:
        kern, part = _convert_kernels(csr.dtype), max(1, -(-n_cols // c))
        # passes 2 and 3 as one grid: a CTA per row group or per HYB_THREADS entries, at most
        # as many as the device holds at once (a CTA past those would wait for a slot)
        ctas = min(max(n_ctas, -(-nnz // HYB_THREADS)),
                   kern.resident("pit_hyb_layout", HYB_THREADS))
        sync = _hyb_counters(dev)
        _launch_ctas(kern, "pit_hyb_layout", ctas, HYB_THREADS, csr.indptr, csr.indices,
                     csr.values, n_rows, n_cols, nnz, c, k, part, scan, n_ctas, n_brows, n_slots,
                     n_fix, n_cut, n_empty, b["table"], b["brow_row"], b["cols"], b["vals"],
                     b["perm"], b["slot_row"], b["ws_index"], b["fix_rows"], b["cut_index"],
                     b["cut_info"], b["empty_rows"], meta, sync[1:])
    else:
        b["table"].zero_()
    return DeviceMatrix("hyb", {"c": c, "k": k}, csr.shape, nnz, csr.dtype, b, csr, info)


def hyb_counts_of(c: int, row_counts: list[int]) -> tuple[int, int, int, int, int, bool]:
    """(workspace, cut, partial, empty, fix rows, any group cut) from pass 1's four row-count
    totals (shared-kind rows, empty rows, cut rows or groups, pieces of cut rows)."""
    n_shared, n_empty, n_cut_groups, n_cut_pieces = row_counts
    cut = n_cut_groups > 0
    n_ws = n_shared if (c > 1 or cut) else 0
    n_cut, n_partials = (n_cut_groups, n_cut_pieces) if c == 1 else (0, 0)
    return n_ws, n_cut, n_partials, n_empty, n_ws + n_empty, cut


def hyb_info(c: int, k: int, nnz: int, rows_h: list[int], n_ws: int, n_cut: int,
             n_partials: int, n_empty: int, n_fix: int, cut: bool) -> dict[str, Any]:
    """The host numbers of an exactly sized hyb layout (``DeviceMatrix.info``)."""
    widths = [1 << (b % (k + 1)) for b in range(c * (k + 1))]
    slot_sizes = [r * w for r, w in zip(rows_h, widths)]
    n_slots = sum(slot_sizes)
    return {"c": c, "k": k, "exact": True, "bucket_rows": list(rows_h), "widths": widths,
            "row_offsets": [0, *accumulate(rows_h)][:-1],
            "slot_offsets": [0, *accumulate(slot_sizes)][:-1], "brows": sum(rows_h),
            "slots": n_slots, "any_cut": cut, "ws_rows": n_ws, "fix_rows": n_fix,
            "cut_rows": n_cut, "partial_rows": n_partials, "empty_rows": n_empty,
            "atomic": [hyb_atomic(c, k, w, cut) for w in widths],
            "padding_ratio": n_slots / nnz if nnz else 1.0}


def hyb_bounds(c: int, k: int, n_rows: int, nnz: int) -> dict[str, Any]:
    """``info`` of a hyb layout sized by bounds: capacities in place of counts, the per-bucket
    numbers unknown (None), and every bucket that might need atomics marked so (the widest
    one when c == 1: some row may be cut)."""
    cap = 1 << k
    widths = [1 << (b % (k + 1)) for b in range(c * (k + 1))]
    one = c == 1
    return {"c": c, "k": k, "exact": False, "bucket_rows": None, "widths": widths,
            "row_offsets": None, "slot_offsets": None,
            "brows": min(nnz, n_rows * c + nnz // cap), "slots": 2 * nnz, "any_cut": None,
            "ws_rows": n_rows, "fix_rows": n_rows, "cut_rows": n_rows if one else 0, "partial_rows": 2 * nnz // cap if one else 0,
            "empty_rows": n_rows, "atomic": [hyb_atomic(c, k, w, True) for w in widths],
            "padding_ratio": None}
