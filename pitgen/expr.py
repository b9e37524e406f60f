"""Tensor expressions in index notation: text -> :class:`Operator`.

Grammar (whitespace free)::

    stmt    := access OP rhs
    OP      := '+=' | 'max=' | 'min=' | '='
    rhs     := product | FUNC '(' product ')'        (a function only with '=')
    product := access ('*' access)*
    access  := NAME '[' index (',' index)* ']'
    index   := affine integer expression of axis names (m, y+r, 2*x+s-1, ...)

Index expressions become sympy expressions so that the rule engine can reason about them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import sympy

from . import cache
from .errors import ExpressionError, ShapeError

#: Reducer written in the expression -> name used everywhere else.
REDUCERS = {"+=": "sum", "max=": "max", "min=": "min", "=": "none"}

#: Elementwise epilogues allowed on the right of '=' (NumPy semantics; CUDA twins in templates).
EPILOGUES = {
    "relu": lambda x: np.maximum(x, 0),
    "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
    "tanh": np.tanh,
    "exp": np.exp,
    "abs": np.abs,
}

#: Bounds that keep parsing (and every later stage) cheap: the nesting depth of brackets and
#: parentheses, the expression's length, and the magnitude of index coefficients and constants
#: (int64, what a kernel's index arithmetic could hold at most).
MAX_DEPTH = 64
MAX_LENGTH = 20_000
MAX_COEFFICIENT = 2**62

_TOKEN = re.compile(
    r"\s*(?:(?P<op>\+=|max=|min=|=)|(?P<name>[A-Za-z_][A-Za-z_0-9]*)"
    r"|(?P<int>[0-9]+)|(?P<punct>[\[\](),*+\-]))"
)


@dataclass(frozen=True)
class _Tok:
    kind: str
    text: str
    col: int  # 1-based


@dataclass(frozen=True)
class Access:
    """One tensor access ``T[e0, e1, ...]``; each ``e`` is an affine sympy expression."""

    tensor: str
    indices: tuple[sympy.Expr, ...]
    column: int
    #: 1-based column where each index starts, so errors can point at the index itself.
    index_columns: tuple[int, ...] = field(default=(), compare=False, repr=False)

    @property
    def rank(self) -> int:
        return len(self.indices)

    @property
    def axes(self) -> tuple[str, ...]:
        """Axes used by this access, in order of first appearance."""
        seen: list[str] = []
        for e in self.indices:
            for s in sorted(e.free_symbols, key=lambda s: s.name):
                if s.name not in seen:
                    seen.append(s.name)
        return tuple(seen)

    def bare_dim(self, axis: str) -> int | None:
        """The dimension indexed by exactly ``axis`` (a bare index), else None."""
        sym = sympy.Symbol(axis, integer=True)
        for d, e in enumerate(self.indices):
            if e == sym:
                return d
        return None

    def dims_of(self, axis: str) -> tuple[int, ...]:
        """Every dimension whose index expression involves ``axis``."""
        sym = sympy.Symbol(axis, integer=True)
        return tuple(d for d, e in enumerate(self.indices) if sym in e.free_symbols)

    def __str__(self) -> str:
        return f"{self.tensor}[{','.join(str(e) for e in self.indices)}]"


@dataclass(frozen=True)
class Operator:
    """A parsed expression: ``output reducer= epilogue(inputs[0] * inputs[1] * ...)``."""

    text: str
    output: Access
    inputs: tuple[Access, ...]
    reducer: str  # 'sum' | 'max' | 'min' | 'none'
    epilogue: str | None
    axes: tuple[str, ...]  # spatial axes (output order), then reduction axes

    @property
    def spatial_axes(self) -> tuple[str, ...]:
        return tuple(a for a in self.axes if a in self.output.axes)

    @property
    def reduction_axes(self) -> tuple[str, ...]:
        return tuple(a for a in self.axes if a not in self.output.axes)

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(a.tensor for a in self.inputs))

    def access(self, tensor: str) -> Access:
        """The (first) access of ``tensor``, input or output."""
        for a in (self.output, *self.inputs):
            if a.tensor == tensor:
                return a
        raise ExpressionError(f"tensor {tensor!r} does not appear in {self.text!r}")

    def accesses_of(self, axis: str) -> tuple[Access, ...]:
        return tuple(a for a in (self.output, *self.inputs) if axis in a.axes)

    def extents(self, shapes: Mapping[str, Sequence[int]]) -> dict[str, int]:
        """Axis extents from the arrays' shapes ("valid" semantics for affine indices).

        Bare indices fix an extent directly; an affine index such as ``y+r`` fixes the one axis
        it leaves unknown so that the largest index value is the dimension's last element.
        """
        ext: dict[str, int] = {}
        for acc in (self.output, *self.inputs):
            shape = shapes.get(acc.tensor)
            if shape is None:
                continue
            if len(shape) != acc.rank:
                raise ShapeError(
                    f"{acc.tensor} has rank {len(shape)}, the expression indexes it with rank {acc.rank}")
            for d, e in enumerate(acc.indices):
                if isinstance(e, sympy.Symbol):
                    _set_extent(ext, e.name, int(shape[d]), acc)
        changed = True
        while changed:
            changed = False
            for acc in self.inputs:
                shape = shapes.get(acc.tensor)
                if shape is None:
                    continue
                for d, e in enumerate(acc.indices):
                    unknown = [s for s in e.free_symbols if s.name not in ext]
                    if len(unknown) != 1:
                        continue
                    s = unknown[0]
                    coef = int(e.coeff(s))
                    rest = e.subs(s, 0)
                    hi = int(rest.subs({sympy.Symbol(a, integer=True): (ext[a] - 1 if rest.coeff(sympy.Symbol(a, integer=True)) > 0 else 0) for a in ext}))
                    if coef <= 0:
                        continue
                    n = (int(shape[d]) - 1 - hi) // coef + 1
                    if n < 1:
                        raise ShapeError(f"{acc.tensor} dimension {d} ({shape[d]}) is too small for index {e}")
                    ext[s.name] = n
                    changed = True
        missing = [a for a in self.axes if a not in ext]
        if missing:
            raise ShapeError(f"cannot infer the extent of axes {missing} from the shapes given")
        return ext

    def view(self, acc: Access, array: np.ndarray, extents: Mapping[str, int]) -> np.ndarray:
        """A strided view of ``array`` with one dimension per axis of ``acc`` (in ``acc.axes``
        order): affine indices become strides, so ``I[n,c,y+r,x+s]`` reads as ``V[n,c,r,y,s,x]``.
        Every index value is bounds-checked first."""
        if array.ndim != acc.rank:
            raise ShapeError(f"{acc.tensor} has rank {array.ndim}, expected {acc.rank}")
        axes = acc.axes
        syms = [sympy.Symbol(a, integer=True) for a in axes]
        strides = [0] * len(axes)
        for d, e in enumerate(acc.indices):
            const = int(e.subs({s: 0 for s in syms}))
            lo = hi = const
            for i, s in enumerate(syms):
                c = int(e.coeff(s))
                strides[i] += c * array.strides[d]
                span = c * (extents[axes[i]] - 1)
                lo, hi = lo + min(0, span), hi + max(0, span)
            if lo < 0 or hi >= array.shape[d]:
                raise ShapeError(
                    f"{acc.tensor} dimension {d} has size {array.shape[d]} but index {e} "
                    f"reaches [{lo}, {hi}]")
        shape = tuple(extents[a] for a in axes)
        start = array[tuple(slice(int(e.subs({s: 0 for s in syms})), None) for e in acc.indices)]
        return np.lib.stride_tricks.as_strided(start, shape=shape, strides=strides, writeable=False)

    def __str__(self) -> str:
        return self.text


def _set_extent(ext: dict[str, int], axis: str, n: int, acc: Access) -> None:
    if axis in ext and ext[axis] != n:
        raise ShapeError(f"axis {axis} has extent {ext[axis]} elsewhere but {n} in {acc.tensor}")
    ext[axis] = n


def _tokenize(text: str) -> list[_Tok]:
    toks, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            col = len(text) - len(text[pos:].lstrip()) + 1
            raise ExpressionError(f"unexpected character {text[col - 1]!r}", text, col)
        kind = m.lastgroup
        toks.append(_Tok(kind, m.group(kind), m.start(kind) + 1))
        pos = m.end()
    stack: list[_Tok] = []
    pairs = {"]": "[", ")": "("}
    for t in toks:
        if t.text in "[(" and t.kind == "punct":
            stack.append(t)
            if len(stack) > MAX_DEPTH:
                raise ExpressionError(f"brackets nested more than {MAX_DEPTH} deep", text, t.col)
        elif t.text in "])" and t.kind == "punct":
            if not stack or stack[-1].text != pairs[t.text]:
                raise ExpressionError(f"unbalanced bracket {t.text!r}", text, t.col)
            stack.pop()
    if stack:
        raise ExpressionError(f"unbalanced bracket {stack[-1].text!r} is never closed", text, stack[-1].col)
    return toks


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.toks = _tokenize(text)
        self.i = 0

    # -- token helpers -------------------------------------------------------------------------
    def peek(self) -> _Tok | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def error(self, msg: str, tok: _Tok | None = None) -> ExpressionError:
        col = tok.col if tok else len(self.text.rstrip()) + 1
        return ExpressionError(msg, self.text, col)

    def take(self, text: str | None = None, kind: str | None = None) -> _Tok:
        t = self.peek()
        if t is None or (text is not None and t.text != text) or (kind is not None and t.kind != kind):
            want = repr(text) if text else kind
            got = repr(t.text) if t else "end of expression"
            raise self.error(f"expected {want}, found {got}", t)
        self.i += 1
        return t

    # -- grammar -------------------------------------------------------------------------------
    def statement(self) -> Operator:
        if not self.toks:
            raise ExpressionError("empty expression", self.text, 1)
        out = self.access()
        op = self.peek()
        if op is None or op.kind != "op":
            raise self.error("expected '+=', 'max=', 'min=' or '=' after the output access", op)
        self.i += 1
        reducer = REDUCERS[op.text]
        epilogue, epi_tok = None, None
        t = self.peek()
        if t is not None and t.kind == "name" and self.i + 1 < len(self.toks) and self.toks[self.i + 1].text == "(":
            epi_tok = t
            if t.text not in EPILOGUES:
                raise self.error(f"unknown function {t.text!r} (known: {', '.join(sorted(EPILOGUES))})", t)
            if reducer != "none":
                raise self.error(
                    f"{t.text}(...) under {op.text!r} is not a valid {reducer}: a reduction combines "
                    f"plain products; apply {t.text} in a separate '=' expression", t)
            self.i += 2
            epilogue = t.text
        inputs = [self.access()]
        while (t := self.peek()) is not None and t.text == "*":
            self.i += 1
            inputs.append(self.access())
        if epi_tok is not None:
            self.take(")")
        if (t := self.peek()) is not None:
            raise self.error(f"unexpected {t.text!r}", t)
        return self.check(out, op, reducer, epilogue, inputs)

    def access(self) -> Access:
        t = self.peek()
        if t is None or t.kind != "name":
            raise self.error("expected a tensor access such as A[m,k]", t)
        self.i += 1
        if t.text in EPILOGUES or (self.peek() is not None and self.peek().text == "("):
            raise self.error(f"unknown function {t.text!r}" if t.text not in EPILOGUES
                             else f"function {t.text!r} is only allowed around the whole right-hand side", t)
        self.take("[")
        cols = [self.peek().col]  # brackets are balanced: a token follows '['
        idx = [self.index()]
        while self.peek() is not None and self.peek().text == ",":
            self.i += 1
            cols.append(self.peek().col)
            idx.append(self.index())
        self.take("]")
        return Access(t.text, tuple(idx), t.col, tuple(cols))

    def index(self) -> sympy.Expr:
        start = self.peek()
        e = self.sum_expr()
        syms = sorted(e.free_symbols, key=lambda s: s.name)
        if syms and sympy.Poly(e, *syms).total_degree() > 1:
            raise self.error(f"index {e} is not affine (products of axes are not allowed)", start)
        return e

    def sum_expr(self) -> sympy.Expr:
        start = self.peek()
        terms = [self.term()]
        while (t := self.peek()) is not None and t.text in "+-" and t.kind == "punct":
            self.i += 1
            terms.append(self.term() if t.text == "+" else -self.term())
        return self.bounded(sympy.Add(*terms), start)

    def term(self) -> sympy.Expr:
        start = self.peek()
        e = self.factor()
        while (t := self.peek()) is not None and t.text == "*":
            self.i += 1
            e = self.bounded(e * self.factor(), start)
        return e

    def bounded(self, e: sympy.Expr, tok: _Tok | None) -> sympy.Expr:
        """``e``, unless a coefficient or constant of it is beyond MAX_COEFFICIENT."""
        if any(c.is_Integer and abs(int(c)) > MAX_COEFFICIENT
               for c in e.as_coefficients_dict().values()) or any(
                   a.is_Integer and abs(int(a)) > MAX_COEFFICIENT for a in sympy.Add.make_args(e)):
            raise self.error(f"index coefficient beyond {MAX_COEFFICIENT} (2^62)", tok)
        return e

    def factor(self) -> sympy.Expr:
        t = self.peek()
        if t is None:
            raise self.error("expected an index, found end of expression")
        if t.kind == "name":
            self.i += 1
            return sympy.Symbol(t.text, integer=True)
        if t.kind == "int":
            self.i += 1
            if len(t.text.lstrip("0")) > 19 or int(t.text) > MAX_COEFFICIENT:
                raise self.error(f"integer {t.text[:24]}{'...' if len(t.text) > 24 else ''} is "
                                 f"beyond {MAX_COEFFICIENT} (2^62)", t)
            return sympy.Integer(int(t.text))
        if t.text == "-":  # a run of unary minus signs, counted rather than recursed into
            signs = 0
            while (t := self.peek()) is not None and t.text == "-":
                self.i += 1
                signs += 1
            e = self.factor()
            return -e if signs % 2 else e
        if t.text == "(":
            self.i += 1
            e = self.sum_expr()
            self.take(")")
            return e
        raise self.error(f"expected an index, found {t.text!r}", t)

    # -- semantic checks ------------------------------------------------------------------------
    def check(self, out: Access, op: _Tok, reducer: str, epilogue: str | None,
              inputs: list[Access]) -> Operator:
        ranks: dict[str, Access] = {}
        for a in (out, *inputs):
            if a.tensor in ranks and ranks[a.tensor].rank != a.rank:
                raise self.error(
                    f"tensor {a.tensor} used with rank {ranks[a.tensor].rank} and rank {a.rank}",
                    _Tok("name", a.tensor, a.column))
            ranks.setdefault(a.tensor, a)
        if any(a.tensor == out.tensor for a in inputs):
            raise self.error(f"output {out.tensor} is also read on the right-hand side",
                             _Tok("name", out.tensor, out.column))
        seen: list[str] = []
        at: dict[str, int] = {}
        for e, col in zip(out.indices, out.index_columns):
            if not isinstance(e, sympy.Symbol):
                raise self.error(f"output index {e} must be a single axis name", _Tok("index", str(e), col))
            if e.name in seen:
                raise self.error(f"output axis {e.name} repeated", _Tok("index", str(e), col))
            seen.append(e.name)
            at[e.name] = col
        rhs_axes: list[str] = []
        for a in inputs:
            rhs_axes += [x for x in a.axes if x not in rhs_axes]
        for ax in seen:
            if ax not in rhs_axes:
                raise self.error(f"output axis {ax} appears on no input", _Tok("index", ax, at[ax]))
        reduction = [a for a in rhs_axes if a not in seen]
        if reducer == "none" and reduction:
            raise self.error(
                f"axis {reduction[0]} appears only on the right of '=': use a reducer (+=, max=, min=)", op)
        return Operator(self.text.strip(), out, tuple(inputs), reducer, epilogue,
                        tuple(seen) + tuple(reduction))


def parse(text: str) -> Operator:
    """Parse an expression such as ``"C[m,n] += A[m,k] * B[k,n]"`` into an :class:`Operator`.

    Raises :class:`pitgen.ExpressionError` with the column of the problem. Remembered per text
    (an Operator is immutable): planning, lowering and the rules each take expression text, and
    building the sympy indices costs about a millisecond.
    """
    if not isinstance(text, str):
        raise ExpressionError(f"expected the expression as a string, got {type(text).__name__}")
    if len(text) > MAX_LENGTH:
        raise ExpressionError(f"expression of {len(text)} characters: at most {MAX_LENGTH}")
    return _parse(text)


@cache.lru("expr.parse", maxsize=1024)
def _parse(text: str) -> Operator:
    return _Parser(text).statement()


def as_operator(op: Operator | str, what: str = "op") -> Operator:
    """``op`` parsed if it is text; an :class:`Operator` as is; anything else refused."""
    if isinstance(op, Operator):
        return op
    if isinstance(op, str):
        return parse(op)
    raise ExpressionError(f"{what} must be an expression string or a pitgen.Operator, got "
                          f"{type(op).__name__}")
