"""Test data and checks for users of pitgen and for its own tests.

- Mask patterns of every granularity (:func:`tile_mask`, :func:`granular_mask`,
  :func:`longformer_mask`) and random CSR matrices (:func:`random_csr`), as plain functions of a
  NumPy generator.
- Hypothesis strategies that draw them, and expressions and shapes: :func:`masks`,
  :func:`csr_matrices`, :func:`expressions`, :func:`extents`, :func:`shapes`. Importing this
  module needs neither Hypothesis nor torch; calling a strategy without Hypothesis raises an
  ImportError that names the package.
- The float64 NumPy references every kernel is held to: :mod:`pitgen.reference` (also reachable
  as ``pitgen.testing.reference``).
- :func:`assert_close`, the dtype-aware comparison the GPU tests make (element-wise, scaled by
  the root-sum-square of each output's terms: :func:`term_scale`, :func:`attention_term_scale`,
  :func:`moe_term_scale`; docs/testing.md), and :func:`poison`, which fills an output before a
  launch so that elements a kernel never writes fail it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Sequence, TypeVar

import numpy as np

from . import reference  # noqa: F401  (the float64 references, re-exported)
from .expr import EPILOGUES
from .graph.formats import CSR, Relational, index_dtype

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

Array = TypeVar("Array")


# -- mask patterns ------------------------------------------------------------------------------


def tile_mask(rng: np.random.Generator, sq: int, sk: int, tile: tuple[int, int],
              density: float, exact: bool = False) -> np.ndarray:
    """Random tiles of ``tile`` (e.g. 128x128 blocks, 1x64 or 16x16 micro-tiles), each set with
    probability ``density`` (``exact``: exactly round(density x tiles) of them, as a benchmark
    cell labelled with its sparsity needs), aligned to the tile grid and cut at the edges."""
    tr, tc = max(1, tile[0]), max(1, tile[1])
    draw = rng.random((-(-sq // tr), -(-sk // tc)))
    if exact:   # the same draw's round(density x tiles) smallest values
        grid = np.zeros(draw.shape, bool)
        grid.flat[np.argsort(draw, axis=None, kind="stable")[: round(density * draw.size)]] = True
    else:
        grid = draw < density
    return np.kron(grid, np.ones((tr, tc), bool))[:sq, :sk]


#: Mask granularities: single elements, micro-tiles (one extent 1), blocks, whole rows or
#: columns, and the two extremes.
MASK_KINDS = ("element", "micro", "block", "row", "col", "empty", "full")
#: Micro-tiles along either dimension (32x1: extent 1 along the columns, 1x64: along the rows).
MICRO_TILES = ((16, 1), (32, 1), (64, 1), (1, 16), (1, 32), (1, 64))
BLOCK_TILES = ((16, 16), (32, 64), (64, 32), (64, 64), (128, 128))


def granular_mask(rng: np.random.Generator, shape: tuple[int, int], kind: str,
                  tile: tuple[int, int] = (1, 1), density: float = 0.3) -> np.ndarray:
    """A bool mask of ``shape`` whose set elements come in whole units of ``kind`` (one of
    MASK_KINDS; ``tile`` is the unit of "micro" and "block"), each unit set with probability
    ``density``; units are aligned to their grid and cut at the edges."""
    rows, cols = shape
    if kind not in MASK_KINDS:
        raise ValueError(f"unknown mask kind {kind!r} (known: {', '.join(MASK_KINDS)})")
    if kind == "empty":
        return np.zeros(shape, bool)
    if kind == "full":
        return np.ones(shape, bool)
    unit = {"element": (1, 1), "row": (1, cols), "col": (rows, 1)}.get(kind, tile)
    return tile_mask(rng, rows, cols, unit, density)


def longformer_mask(sq: int, sk: int, window: int, global_tokens: np.ndarray) -> np.ndarray:
    """Longformer: a band |i - j| <= window // 2, plus global tokens (different every batch) that
    attend to every key and that every query attends to."""
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    m = np.abs(i - j) <= window // 2
    g = np.asarray(global_tokens, np.int64)
    m[g[g < sq], :] = True
    m[:, g[g < sk]] = True
    return m


def bigbird_mask(rng: np.random.Generator, sq: int, sk: int, window: int,
                 global_tokens: np.ndarray, random_keys: int, block: int = 64) -> np.ndarray:
    """BigBird-style: a band |i - j| <= window // 2, global tokens (attending to every key and
    attended by every query), and per ``block`` query rows ``random_keys`` random keys that
    all rows of the block attend (BigBird's random attention, at key granularity)."""
    m = longformer_mask(sq, sk, window, global_tokens)
    for r0 in range(0, sq, block):
        m[r0:r0 + block, rng.choice(sk, size=min(random_keys, sk), replace=False)] = True
    return m


def random_global_tokens(rng: np.random.Generator, seq: int, count: int) -> np.ndarray:
    """``count`` distinct token positions (Longformer's dynamic global tokens)."""
    return np.sort(rng.choice(seq, size=min(count, seq), replace=False))


# -- sparse matrices ----------------------------------------------------------------------------

#: CSR shapes that break kernels: empty rows, one dense row, a fifth of the rows full (cut by
#: hyb), power-law row lengths with popular columns (graphs), one column, no non-zero at all,
#: and no row or no column.
CSR_KINDS = ("random", "empty_rows", "dense_row", "long_rows", "power_law", "one_col", "nnz0",
             "empty")


def random_csr(rng: np.random.Generator, shape: tuple[int, int], kind: str = "random",
               density: float = 0.1, values: bool = True) -> CSR:
    """A CSR of ``shape`` and ``kind`` (one of CSR_KINDS; "one_col" and "empty" keep ``shape``
    as given), built from its rows' column lists rather than from a dense array; non-zero
    float64 values, or a pattern only (``values=False``)."""
    rows, cols = shape
    if kind not in CSR_KINDS:
        raise ValueError(f"unknown CSR kind {kind!r} (known: {', '.join(CSR_KINDS)})")
    if kind == "power_law" and rows and cols:
        weight = rng.pareto(1.5, rows) + 1.0     # row lengths: a few hubs far above the mean
        lengths = np.minimum(cols, np.round(weight / weight.mean() * density * cols)).astype(int)
        popularity = 1.0 / np.arange(1, cols + 1) ** 0.8
        popularity = rng.permutation(popularity / popularity.sum())
        col_lists = [np.sort(rng.choice(cols, n, replace=False, p=popularity)) for n in lengths]
    else:
        mask = rng.random((rows, cols)) < density
        if kind == "empty_rows" and rows:
            mask[rng.random(rows) < 0.5] = False
        if kind == "dense_row" and rows:
            mask[rng.integers(rows)] = True
        if kind == "long_rows" and rows:
            mask[rng.random(rows) < 0.2] = True
        if kind == "nnz0":
            mask[:] = False
        col_lists = [np.flatnonzero(r) for r in mask]
    lengths = np.array([len(c) for c in col_lists], np.int64)
    nnz = int(lengths.sum())
    dt = index_dtype(cols, nnz)
    indptr = np.zeros(rows + 1, dt)
    np.cumsum(lengths, out=indptr[1:])
    indices = np.concatenate([np.zeros(0, dt), *col_lists]).astype(dt)
    data = None
    if values:
        data = rng.standard_normal(nnz)
        data[data == 0] = 1.0
    return CSR((rows, cols), indptr, indices, data)


# -- Hypothesis strategies ----------------------------------------------------------------------


def _strategies() -> Any:
    """hypothesis.strategies, imported when a strategy is first asked for."""
    try:
        from hypothesis import strategies
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("pitgen.testing's strategies need Hypothesis: pip install hypothesis "
                          "(or pitgen[test])") from e
    return strategies


def _known(kinds: Sequence[str], known: Sequence[str], what: str) -> None:
    unknown = [k for k in kinds if k not in known]
    if unknown or not kinds:
        raise ValueError(f"unknown {what} kinds {unknown} (known: {', '.join(known)})")


def extents(max_side: int = 200) -> SearchStrategy[int]:
    """Extents in 1..max_side, tile multiples (16 to 256) as often as any other size: kernels
    break at edges that are not tile multiples, and at ones that are."""
    st = _strategies()
    multiples = [v for v in (16, 32, 64, 128, 256) if v <= max_side]
    sizes = st.integers(1, max_side)
    return st.one_of(sizes, st.sampled_from(multiples)) if multiples else sizes


def shapes(rank: int = 2, max_side: int = 200) -> SearchStrategy[tuple[int, ...]]:
    """Tuples of ``rank`` :func:`extents`."""
    st = _strategies()
    return st.tuples(*[extents(max_side)] * rank)


@dataclass(frozen=True, repr=False)
class Mask:
    """A drawn mask and how it was made: ``array`` (bool) is set in whole ``tile`` units aligned
    to their grid ((1, 1) for "element", (1, cols) for "row", the whole shape for "empty" and
    "full"), each unit with probability ``density``."""
    array: np.ndarray
    kind: str
    tile: tuple[int, int]
    density: float

    def __repr__(self) -> str:  # the array itself would flood a failure report
        r, c = self.array.shape
        return (f"Mask({self.kind} {self.tile[0]}x{self.tile[1]}, shape {r}x{c}, "
                f"density {self.density}, {int(self.array.sum())} set)")


def masks(shape: tuple[int, int] | SearchStrategy[tuple[int, int]] | None = None, *,
          kinds: Sequence[str] = MASK_KINDS, micro_tiles: Sequence[tuple[int, int]] = MICRO_TILES,
          block_tiles: Sequence[tuple[int, int]] = BLOCK_TILES,
          densities: Sequence[float] = (0.05, 0.3, 0.7), max_side: int = 200) -> SearchStrategy[Mask]:
    """Masks (:class:`Mask`) of a fixed ``shape``, of shapes drawn from a strategy, or of
    :func:`shapes` up to ``max_side`` (tile multiples and not), in every granularity of
    ``kinds``."""
    st = _strategies()
    _known(kinds, MASK_KINDS, "mask")
    if shape is None:
        shape = shapes(2, max_side)
    elif isinstance(shape, tuple):
        shape = st.just(shape)

    @st.composite
    def draw_mask(draw: Any) -> Mask:
        rows, cols = draw(shape)
        kind = draw(st.sampled_from(list(kinds)))
        tile = {"element": (1, 1), "row": (1, cols), "col": (rows, 1), "empty": (rows, cols),
                "full": (rows, cols)}.get(kind)
        if tile is None:
            tile = draw(st.sampled_from(list(micro_tiles if kind == "micro" else block_tiles)))
        density = draw(st.sampled_from(list(densities)))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        return Mask(granular_mask(rng, (rows, cols), kind, tile, density), kind, tile, density)

    return draw_mask()


def csr_matrices(*, max_rows: int = 70, max_cols: int = 90, kinds: Sequence[str] = CSR_KINDS,
                 densities: Sequence[float] = (0.02, 0.1, 0.4),
                 values: bool = True) -> SearchStrategy[CSR]:
    """:func:`random_csr` matrices (``pitgen.graph.formats.CSR``) of every kind in ``kinds``, up
    to ``max_rows`` x ``max_cols``."""
    st = _strategies()
    _known(kinds, CSR_KINDS, "CSR")

    @st.composite
    def draw_csr(draw: Any) -> CSR:
        kind = draw(st.sampled_from(list(kinds)))
        rows = draw(st.integers(1, max_rows))
        cols = 1 if kind == "one_col" else draw(st.integers(1, max_cols))
        if kind == "empty":
            rows, cols = draw(st.sampled_from([(0, cols), (rows, 0), (0, 0)]))
        density = draw(st.sampled_from(list(densities)))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        return random_csr(rng, (rows, cols), kind, density, values)

    return draw_csr()


def relational_graphs(*, max_relations: int = 5, max_rows: int = 12, max_cols: int = 12,
                      kinds: Sequence[str] = CSR_KINDS[:-1],
                      densities: Sequence[float] = (0.05, 0.2, 0.5)) -> SearchStrategy[Relational]:
    """Relation-typed graphs (``pitgen.graph.formats.Relational``): up to ``max_relations``
    relations of one shape, each a :func:`random_csr` of its own kind (empty relations, empty
    rows and columns, hubs, ...), so isolated nodes and relations without edges are drawn."""
    st = _strategies()
    _known(kinds, CSR_KINDS, "CSR")

    @st.composite
    def draw_graph(draw: Any) -> Relational:
        rows, cols = draw(st.integers(1, max_rows)), draw(st.integers(1, max_cols))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        rels = [random_csr(rng, (rows, cols), kind, draw(st.sampled_from(list(densities))))
                for kind in draw(st.lists(st.sampled_from([k for k in kinds if k != "one_col"]),
                                          min_size=1, max_size=max_relations))]
        return Relational.from_relations(rels)

    return draw_graph()


#: Expression families: matmul with any operand order and transposition, batched matmul, conv
#: (1-D or 2-D, indexed by y+r), an element-wise epilogue, and max/min/sum reductions.
EXPRESSION_KINDS = ("matmul", "batched", "conv", "elementwise", "reduce")
_AXES = ("i", "j", "k", "m", "n", "p", "q", "t", "row", "col", "kk")
_TENSORS = ("A", "B", "X", "W", "Q", "K", "lhs", "rhs", "in_1", "Out")


@dataclass(frozen=True)
class Expression:
    """A drawn expression and what holds for it by construction: its ``reduction`` axes, and the
    ``fixed`` axes that are not permutation invariant (those inside a conv's y+r); every other
    axis is."""
    text: str
    kind: str
    reduction: frozenset[str]
    fixed: frozenset[str]


def expressions(kinds: Sequence[str] = EXPRESSION_KINDS) -> SearchStrategy[Expression]:
    """Expressions (:class:`Expression`) of the families in ``kinds``, with drawn axis and tensor
    names, operand orders and transpositions."""
    st = _strategies()
    _known(kinds, EXPRESSION_KINDS, "expression")

    @st.composite
    def draw_expression(draw: Any) -> Expression:
        kind = draw(st.sampled_from(list(kinds)))
        ax = draw(st.lists(st.sampled_from(_AXES), min_size=7, max_size=7, unique=True))
        out, t1, t2 = draw(st.lists(st.sampled_from(_TENSORS), min_size=3, max_size=3, unique=True))
        sep = draw(st.sampled_from([",", ", "]))

        def acc(name: str, idx: Sequence[str]) -> str:
            return f"{name}[{sep.join(idx)}]"

        def maybe_swap(pair: list[str]) -> list[str]:
            return pair[::-1] if draw(st.booleans()) else pair

        if kind in ("matmul", "batched"):
            m, n, k, b = ax[:4]
            a_idx, b_idx, c_idx = maybe_swap([m, k]), maybe_swap([k, n]), maybe_swap([m, n])
            if kind == "batched":
                for idx in (a_idx, b_idx, c_idx):
                    idx.insert(draw(st.integers(0, 2)), b)
            rhs = maybe_swap([acc(t1, a_idx), acc(t2, b_idx)])
            return Expression(f"{acc(out, c_idx)} += {rhs[0]} * {rhs[1]}", kind,
                              frozenset({k}), frozenset())
        if kind == "conv":
            n, f, c, y, r, x, s = ax
            pairs = [(y, r), (x, s)][:draw(st.integers(1, 2))]
            sums = [f"{p}+{q}" if draw(st.booleans()) else f"{q}+{p}" for p, q in pairs]
            text = (f"{acc(out, [n, f, *(p for p, _ in pairs)])} += {acc(t1, [n, c, *sums])} * "
                    f"{acc(t2, [f, c, *(q for _, q in pairs)])}")
            return Expression(text, kind, frozenset({c, *(q for _, q in pairs)}),
                              frozenset(a for pair in pairs for a in pair))
        if kind == "elementwise":
            m, n = ax[:2]
            rhs = acc(t1, maybe_swap([m, n]))
            if draw(st.booleans()):
                rhs += f" * {acc(t2, draw(st.sampled_from([[n], [m, n]])))}"
            fn = draw(st.sampled_from([None, *sorted(EPILOGUES)]))
            return Expression(f"{acc(out, [m, n])} = {f'{fn}({rhs})' if fn else rhs}", kind,
                              frozenset(), frozenset())
        m, k = ax[:2]
        reducer = draw(st.sampled_from(["+=", "max=", "min="]))
        rhs = acc(t1, maybe_swap([m, k])) + (f" * {acc(t2, [k])}" if draw(st.booleans()) else "")
        return Expression(f"{acc(out, [m])} {reducer} {rhs}", kind, frozenset({k}), frozenset())

    return draw_expression()


# -- comparing results --------------------------------------------------------------------------

#: Relative-norm error bound per compute type against float64, the ones the GPU tests hold
#: kernels to: float32 on CUDA cores (graph formats), tf32 tensor cores (float32 GEMM and
#: SDDMM: operands rounded to 10 mantissa bits), float16/bfloat16 tensor cores accumulating in
#: float32, and float64 (the NumPy executor: summation order alone differs).
TOLERANCES: dict[str, float] = {"float64": 1e-12, "float32": 1e-5, "tf32": 5e-4,
                                "float16": 1e-2, "bfloat16": 1e-2}
#: Each element may miss by ELEMENT_SLACK x the bound, relative to its own size plus the
#: reference's root mean square: above the worst rounding of one element (a single product
#: rounded twice, a result that cancels), yet one wrong element shows even where the norm of
#: the error would hide it among many right ones.
ELEMENT_SLACK = 10.0


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, str):
        return dtype
    name = str(dtype)
    return name[len("torch."):] if name.startswith("torch.") else np.dtype(dtype).name


def _tolerance(name: str) -> float:
    """The bound for ``name``; 0 (exact) for integer and bool dtypes."""
    if name in TOLERANCES:
        return TOLERANCES[name]
    try:
        dt = np.dtype(name)
    except TypeError:
        dt = None
    if dt is not None and (np.issubdtype(dt, np.integer) or dt == np.bool_):
        return 0.0
    raise ValueError(f"no bound for dtype {name!r}: give one of {', '.join(TOLERANCES)}, an "
                     f"integer dtype, or tol=")


def _numpy(x: Any) -> np.ndarray:
    """NumPy copy of a torch tensor (via .cpu().double(): bfloat16 has no NumPy type) or array."""
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        return (x.double() if x.is_floating_point() else x).numpy()
    return np.asarray(x)


def _first(bad: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(bad)[0])


#: The element-wise bound of a product's output (``assert_close(..., scale=)``):
#: ``|actual - expected| <= E_OUT * |expected| + (E_ACC + roundings * E_ROUND) * scale
#: + SMALLEST_NORMAL``. E_OUT is the output type's rounding (two ulps of slack), E_ACC what the
#: accumulation and any rounded operand (tf32) add per unit of ``scale``, the root-sum-square of
#: the summed terms (:func:`term_scale`): random rounding grows with it, about six of its
#: standard deviations.
E_OUT: dict[str, float] = {"float64": 2.0**-50, "float32": 2.0**-22, "tf32": 2.0**-22,
                           "float16": 2.0**-10, "bfloat16": 2.0**-7}
E_ACC: dict[str, float] = {"float64": 2.0**-44, "float32": 2.0**-12, "tf32": 2.0**-8,
                           "float16": 2.0**-10, "bfloat16": 2.0**-10}
#: What each intermediate rounding to the storage type adds per unit of ``scale``: a partial
#: result stored in the dtype before the last step (a product rounded before its bias is added,
#: RGCN's XW, MoE's activations, attention's P, a split-k partial cuBLAS reduces in fp16) is off
#: by at most one unit roundoff u of its value, uniformly (standard deviation u / sqrt(3) of a
#: value about as large as the root-sum-square of its terms), summed with random signs: 4 u is
#: about seven standard deviations. tf32 intermediates are stored as float32.
E_ROUND: dict[str, float] = {"float64": 2.0**-51, "float32": 2.0**-22, "tf32": 2.0**-22,
                             "float16": 2.0**-9, "bfloat16": 2.0**-6}
#: Smallest normal of each output type: the absolute floor (an exact zero may come back as a
#: flushed denormal).
SMALLEST_NORMAL: dict[str, float] = {"float64": float(np.finfo(np.float64).tiny),
                                     "float32": float(np.finfo(np.float32).tiny),
                                     "tf32": float(np.finfo(np.float32).tiny),
                                     "float16": float(np.finfo(np.float16).tiny),
                                     "bfloat16": 2.0**-126}


def _squared(x: Any) -> Any:
    """``x`` with every element squared, in float64: an array, or a CSR / Relational's values."""
    if isinstance(x, (CSR, Relational)):
        return replace(x, data=x.values() ** 2)
    return _numpy(x).astype(np.float64) ** 2


def term_scale(reference: Any, *operands: Any) -> np.ndarray:
    """``scale`` for :func:`assert_close` of a product: ``sqrt(reference(A*A, B*B, ...))``, the
    root-sum-square of the terms each output sums, for a ``reference`` that is linear in each
    operand (matmul, SpMM, SDDMM, RGCN: each term a product of one element of each operand).
    Operands are arrays, torch tensors, or ``pitgen.graph.formats`` CSR / Relational matrices
    (their values squared), e.g. ``term_scale(reference.spmm_csr, csr, x)``."""
    return np.sqrt(np.abs(_numpy(reference(*(_squared(x) for x in operands)))))


def attention_term_scale(q: Any, k: Any, v: Any, mask: Any,
                         scale: float | None = None) -> np.ndarray:
    """``scale`` for :func:`assert_close` of masked attention: the root-sum-square of the terms
    of O = P V, ``sqrt(P*P @ V*V)`` with P the float64 softmax probabilities (the kernels
    round P to the input type before P V: pass ``roundings=1``)."""
    q, k, v = (_numpy(x).astype(np.float64) for x in (q, k, v))
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    m = np.broadcast_to(_numpy(mask) != 0, q.shape[:-2] + (q.shape[-2], k.shape[-2]))
    s = np.where(m, np.einsum("...id,...jd->...ij", q, k) * scale, -np.inf)
    mx = s.max(axis=-1, keepdims=True)
    p = np.where(m, np.exp(s - np.where(np.isfinite(mx), mx, 0.0)), 0.0)
    denom = p.sum(axis=-1, keepdims=True)
    p = np.divide(p, denom, out=np.zeros_like(p), where=denom > 0)
    return np.sqrt(np.einsum("...ij,...jd->...id", p * p, v * v))


def moe_term_scale(x: Any, expert_ids: Any, gates: Any, w1: Any, w2: Any, b1: Any = None,
                   b2: Any = None, activation: str = "gelu") -> np.ndarray:
    """``scale`` for :func:`assert_close` of the MoE layer: the root-sum-square of the terms of
    the second GEMM, ``gate * act(x W1 + b1)[f] * W2[f]`` and ``gate * b2`` over every pair
    routed to a token (the kernel rounds the activations to the input type in between: pass
    ``roundings=1``)."""
    x, g, ids = _numpy(x).astype(np.float64), _numpy(gates).astype(np.float64), _numpy(expert_ids)
    w1, w2 = _numpy(w1).astype(np.float64), _numpy(w2).astype(np.float64)
    topk = ids.shape[1]
    sq = np.zeros((x.shape[0], w2.shape[2]))
    for e in range(w1.shape[0]):
        pairs = np.flatnonzero(ids.reshape(-1) == e)
        if not len(pairs):
            continue
        h = x[pairs // topk] @ w1[e] + (0.0 if b1 is None else _numpy(b1)[e])
        terms = (reference.activation_reference(h, activation) ** 2) @ w2[e] ** 2
        if b2 is not None:
            terms = terms + _numpy(b2).astype(np.float64)[e] ** 2
        np.add.at(sq, pairs // topk, g.reshape(-1)[pairs, None] ** 2 * terms)
    return np.sqrt(sq)


def assert_close(actual: Any, expected: Any, dtype: Any, *, scale: Any = None,
                 e_out: float | None = None, e_acc: float | None = None,
                 roundings: int = 0, tol: float | None = None, magnitude: Any = None,
                 k: int = 1, what: str = "output") -> None:
    """Assert that ``actual`` (a torch tensor or NumPy array, from a kernel computing in
    ``dtype``: a name of TOLERANCES, a torch or NumPy dtype) matches the float64 ``expected``.

    Same shape, no NaN and no infinity always (an unwritten, :func:`poison` ed element never
    passes); integer and bool dtypes exactly. With ``scale`` (a product's outputs: the
    magnitude of the terms each output sums, :func:`term_scale`; ``|A|·|B|``, which is larger,
    also works and is looser), every element on its own:
    ``|actual - expected| <= e_out * |expected| + (e_acc + roundings * E_ROUND) * scale +
    smallest normal`` (E_OUT, E_ACC, E_ROUND and SMALLEST_NORMAL of the dtype by default;
    ``roundings``: how many times the kernel stores a partial result in the dtype before the
    output, see E_ROUND): a single dropped term or wrong element fails, however many right ones
    surround it. Without ``scale``
    (operators that are not a plain product):

    - the same shape, and no NaN: an unwritten (:func:`poison` ed) element or a bad read never
      passes; no infinity either;
    - relative-norm error ``||actual - expected|| / scale <= tol`` (``tol`` defaults to
      TOLERANCES[dtype]), where scale is ``||expected||``, or at least ``||magnitude|| / sqrt(k)``
      when ``magnitude`` (the same product over absolute values) and the reduction length ``k``
      are given: a result that cancels to much less than its terms is held to the error that its
      terms' rounding makes, not to its own size;
    - every element within ``ELEMENT_SLACK * tol * (|expected| + |magnitude| / sqrt(k) + rms)``,
      rms being scale / sqrt(size): one wrong element shows;
    - exact zeros where the scale is zero; exact equality for integer and bool dtypes.
    """
    name = _dtype_name(dtype)
    bound = _tolerance(name) if tol is None else float(tol)
    got, ref = _numpy(actual), _numpy(expected)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != reference shape {ref.shape}"
    if scale is not None and bound != 0.0:
        _assert_within(got, ref, name, _numpy(scale), e_out, e_acc, roundings, what)
        return
    if bound == 0.0:
        bad = got != ref
        assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.size} elements differ, first at "
                               f"{_first(bad)}: {got[bad][0]!r} != {ref[bad][0]!r}")
        return
    got, ref = got.astype(np.float64), ref.astype(np.float64)
    _finite(got, ref, what)
    floor = np.zeros_like(ref)
    scale = float(np.linalg.norm(ref))
    if magnitude is not None:
        floor = np.abs(_numpy(magnitude).astype(np.float64)) / np.sqrt(max(k, 1))
        assert floor.shape == ref.shape, f"{what}: magnitude shape {floor.shape} != {ref.shape}"
        scale = max(scale, float(np.linalg.norm(floor)))
    if scale == 0.0:
        bad = got != 0
        assert not bad.any(), (f"{what}: the reference is zero but {int(bad.sum())} elements are "
                               f"not, first at {_first(bad)}: {got[bad][0]!r}")
        return
    diff = np.abs(got - ref)
    err = float(np.linalg.norm(diff)) / scale
    assert err <= bound, f"{what}: relative error {err:.3g} > {bound:g} ({name})"
    limit = ELEMENT_SLACK * bound * (np.abs(ref) + floor + scale / np.sqrt(ref.size))
    bad = diff > limit
    if bad.any():
        worst = np.unravel_index(int(np.argmax(diff - limit)), diff.shape)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} elements off by more than the {name} bound, "
            f"worst at {tuple(int(i) for i in worst)}: {got[worst]!r} vs {ref[worst]!r} "
            f"(bound {limit[worst]:.3g})")


def _finite(got: np.ndarray, ref: np.ndarray, what: str) -> None:
    if not np.isfinite(ref).all():
        raise ValueError(f"{what}: the reference is not finite at {_first(~np.isfinite(ref))}")
    nan = np.isnan(got)
    assert not nan.any(), (f"{what}: {int(nan.sum())} of {nan.size} elements are NaN, first at "
                           f"{_first(nan)}: unwritten (poisoned) or a bad read")
    inf = np.isinf(got)
    assert not inf.any(), f"{what}: {int(inf.sum())} infinite elements, first at {_first(inf)}"


def _assert_within(got: np.ndarray, ref: np.ndarray, name: str, scale: np.ndarray,
                   e_out: float | None, e_acc: float | None, roundings: int, what: str) -> None:
    """The element-wise bound of :func:`assert_close` with ``scale``."""
    if name not in E_OUT:
        raise ValueError(f"no element-wise bound for dtype {name!r}: one of {', '.join(E_OUT)}")
    got, ref = got.astype(np.float64), ref.astype(np.float64)
    scale = np.abs(np.broadcast_to(scale.astype(np.float64), ref.shape))
    _finite(got, ref, what)
    if roundings < 0:
        raise ValueError(f"roundings must be >= 0, got {roundings}")
    acc = (E_ACC[name] if e_acc is None else e_acc) + roundings * E_ROUND[name]
    limit = ((E_OUT[name] if e_out is None else e_out) * np.abs(ref) + acc * scale
             + SMALLEST_NORMAL[name])
    excess = np.abs(got - ref) - limit
    bad = excess > 0
    if bad.any():
        worst = np.unravel_index(int(np.argmax(excess)), ref.shape)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} elements beyond the {name} bound, worst at "
            f"{tuple(int(i) for i in worst)}: {got[worst]!r} vs {ref[worst]!r} (bound "
            f"{limit[worst]:.3g}, scale {scale[worst]:.3g})")


#: Examples per kernel family's GPU property test under the ``thorough`` profile
#: (PITGEN_HYPOTHESIS=thorough; ``scripts/device_session.sh thorough``).
THOROUGH_EXAMPLES = 2000


def examples(n: int, share: int = 1) -> int:
    """``max_examples`` of a GPU property test: ``n`` (the fast profile), or when
    ``PITGEN_HYPOTHESIS=thorough`` selects the thorough profile at least THOROUGH_EXAMPLES /
    ``share``: a test parametrized into ``share`` items that together cover one kernel family
    (each item draws its own examples) gives the family THOROUGH_EXAMPLES in all."""
    if os.environ.get("PITGEN_HYPOTHESIS") != "thorough":
        return n
    return max(n, -(-THOROUGH_EXAMPLES // max(1, share)))


def poison(t: Array) -> Array:
    """Fill ``t`` (a torch tensor or NumPy array: an output about to be written by a kernel) with
    NaN, or for integers with the dtype's most negative value (largest for unsigned), and return
    it: an element the kernel leaves unwritten then fails :func:`assert_close` instead of
    passing on whatever the memory held."""
    if hasattr(t, "fill_"):  # torch
        import torch

        if t.dtype == torch.bool:
            raise TypeError("a bool output cannot be poisoned: every value is legal")
        if t.is_floating_point():
            value: Any = float("nan")
        else:
            info = torch.iinfo(t.dtype)
            value = info.min if info.min < 0 else info.max
        t.fill_(value)
        return t
    if not isinstance(t, np.ndarray):
        raise TypeError(f"poison takes a torch tensor or a NumPy array, got {type(t).__name__}")
    if t.dtype == np.bool_:
        raise TypeError("a bool output cannot be poisoned: every value is legal")
    if np.issubdtype(t.dtype, np.integer):
        info = np.iinfo(t.dtype)
        t.fill(info.min if info.min < 0 else info.max)
    else:
        t.fill(np.nan)
    return t
