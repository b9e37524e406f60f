"""The PIT rule engine: which loop axes of an operator are permutation invariant, and what a
kernel needs at run time to exploit that (SRead: gather; SWrite: scatter back).

Every verdict is reached twice: by a structural argument over the index expressions, and by
evaluating the operator on small symbolic tensors before and after a permutation. The two must
agree; a disagreement is a bug in pitgen and raises :class:`RuleError`.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Mapping

import sympy

from . import cache
from .errors import RuleError
from .expr import Operator, as_operator, parse

COMMUTATIVE_REDUCERS = ("sum", "max", "min")

#: Extent of the axis under the symbolic check, and of every other axis meanwhile. Three is the
#: smallest extent where the rotation and the swap below differ; together they generate every
#: permutation of the axis, so invariance under both is invariance under all.
CHECK_EXTENT = 3
OTHER_EXTENT = 2
#: Axes that share no access with the axis under the check cannot change what permuting it
#: does, so they get extent 1: the check evaluates CHECK_EXTENT * OTHER_EXTENT**s points, s the
#: number of axes sharing an access with it. That count is bounded, so the work per axis is
#: bounded and the work per expression grows linearly with its axes; beyond the bound the
#: expression is refused (RuleError) rather than checked for hours.
MAX_SHARING_AXES = 8

#: Permutations of ``n`` positions, as the position each position gathers from.
PERMUTATIONS: dict[str, Callable[[int], tuple[int, ...]]] = {
    "rotation": lambda n: tuple((p + 1) % n for p in range(n)),
    "swap": lambda n: (1, 0, *range(2, n)),
}

_SYMBOLIC_REDUCERS = {
    "sum": sympy.Add,
    # The terms are products of distinct symbols, so none dominates another: evaluating the
    # lattice operation would only cost time. The argument set still makes it order-free.
    "max": lambda *terms: sympy.Max(*terms, evaluate=False),
    "min": lambda *terms: sympy.Min(*terms, evaluate=False),
}

_SYMBOLIC_EPILOGUES = {
    "relu": lambda x: sympy.Max(x, 0),
    "sigmoid": lambda x: 1 / (1 + sympy.exp(-x)),
    "tanh": sympy.tanh,
    "exp": sympy.exp,
    "abs": sympy.Abs,
}


@dataclass(frozen=True)
class AxisRule:
    axis: str
    role: str  # 'spatial' | 'reduction'
    invariant: bool
    needs: tuple[str, ...]  # subset of ('SRead', 'SWrite')
    reason: str
    #: Outcome of the symbolic check that confirmed ``invariant`` (shown by explain()).
    symbolic: str = ""

    def to_json(self) -> dict:
        return {"role": self.role, "invariant": self.invariant, "needs": list(self.needs),
                "reason": self.reason}


@dataclass(frozen=True)
class Rules:
    operator: Operator
    axes: dict[str, AxisRule] = field(default_factory=dict)

    def invariant_axes(self) -> tuple[str, ...]:
        return tuple(a for a, r in self.axes.items() if r.invariant)

    def require_invariant(self, axis: str) -> AxisRule:
        """The rule of ``axis``; :class:`RuleError` with the reason if it is not invariant."""
        if axis not in self.axes:
            raise RuleError(f"{axis!r} is not an axis of {self.operator.text!r} "
                            f"(axes: {', '.join(self.axes)})")
        rule = self.axes[axis]
        if not rule.invariant:
            raise RuleError(f"axis {axis} of {self.operator.text!r} is not permutation invariant: "
                            f"{rule.reason}")
        return rule

    def to_json(self) -> dict:
        return {"expression": self.operator.text,
                "axes": {a: r.to_json() for a, r in self.axes.items()}}

    def explain(self) -> str:
        """The derivation, axis by axis: how each access uses the axis, what the reducer allows,
        the verdict with what a kernel needs, and how the symbolic check confirmed it."""
        op = self.operator
        if op.reducer in COMMUTATIVE_REDUCERS:
            reducer = f"{op.reducer} (commutative and associative: any order of the reduction axes)"
        else:
            reducer = "none ('='): no reduction axes"
        lines = [f"PIT rules for {op.text}", f"  reducer: {reducer}"]
        for a, r in self.axes.items():
            verdict = "invariant" if r.invariant else "NOT invariant"
            needs = ", ".join(r.needs) if r.needs else "nothing"
            lines += [f"  {a}: {r.role} axis, {verdict}; needs {needs}",
                      f"      uses: {_uses(op, a)}",
                      f"      rule: {r.reason}",
                      f"      symbolic check: {r.symbolic}"]
        return "\n".join(lines)


def _uses(op: Operator, axis: str) -> str:
    sym = sympy.Symbol(axis, integer=True)
    uses = []
    for acc in op.accesses_of(axis):
        for d in acc.dims_of(axis):
            e = acc.indices[d]
            how = "bare" if e == sym else f"in {e} (not bare)"
            uses.append(f"{acc.tensor} dim {d} {how}")
    return "; ".join(uses)


def _structural(op: Operator, axis: str) -> AxisRule:
    role = "spatial" if axis in op.output.axes else "reduction"
    sym = sympy.Symbol(axis, integer=True)
    for acc in op.accesses_of(axis):
        for d in acc.dims_of(axis):
            e = acc.indices[d]
            if e != sym:
                others = sorted(s.name for s in e.free_symbols if s != sym)
                how = (f"coupled to {', '.join(others)}" if others
                       else f"scaled by {e.coeff(sym)}" if e.coeff(sym) != 1
                       else f"shifted by {e - sym}")
                return AxisRule(axis, role, False, (),
                                f"{acc.tensor} indexes dimension {d} by {e}: {axis} is {how} "
                                f"there, so a permutation of that dimension is not a relabelling "
                                f"of {axis}")
    if role == "reduction" and op.reducer not in COMMUTATIVE_REDUCERS:
        return AxisRule(axis, role, False, (),
                        f"reducer {op.reducer} is not commutative and associative")
    users = ", ".join(f"{a.tensor}[dim {','.join(map(str, a.dims_of(axis)))}]"
                      for a in op.accesses_of(axis))
    if role == "reduction":
        return AxisRule(axis, role, True, ("SRead",),
                        f"{axis} is a bare index of {users} and {op.reducer} is commutative and "
                        f"associative: any order of {axis} gives the same output; gather the "
                        f"non-zero micro-tiles (SRead), nothing to scatter")
    return AxisRule(axis, role, True, ("SRead", "SWrite"),
                    f"{axis} is a bare index of {users}: output slice {axis}=i depends only on the "
                    f"inputs' slices {axis}=i, so slices can be computed in any order (SRead) and "
                    f"written back to their own positions (SWrite)")


# -- symbolic check -------------------------------------------------------------------------------
#
# Each input access reads its tensor through a gather: position p of a permuted dimension reads
# position g(p) of the tensor. The access is its own operand (A[m,k] * A[k,n] gathers the two
# reads of A independently), as in a kernel that gathers each operand's tiles.
#
# A dimension indexed by the bare axis has exactly the axis's positions, and is gathered by the
# axis permutation itself. Any other dimension involving the axis (y+r, 2*x, k+1, 2-k) is given
# its positions from min(0, lowest index) to one past the highest index it reaches, and is
# gathered by the same kind of permutation (rotation or swap) of all those positions. The spare
# position matters: without it a shifted or mirrored reduction such as A[m,k+3] or A[m,2-k] would
# be gathered by a mere relabelling of k and pass, although no kernel gathers micro-tiles along
# such a dimension. With it the rotation moves every read of that dimension one position on.

#: (access, dim) -> (low, number of positions, permutation kind): the permutation is applied
#: position by position (:func:`_moved`), never spelled out, so that a dimension reached through
#: a huge coefficient (``A[1000000000*m+k]``) costs no memory.
_Gather = dict[tuple[int, int], tuple[int, int, str]]


def _moved(kind: str, p: int, n: int) -> int:
    """Where position ``p`` of ``n`` gathers from under PERMUTATIONS[kind]."""
    if kind == "rotation":
        return (p + 1) % n
    return 1 - p if p < 2 else p


def _affine(e: sympy.Expr, axes: tuple[str, ...]) -> tuple[int, tuple[int, ...]]:
    """(constant, coefficient of each axis) of the affine index ``e``."""
    terms = {(t.name if isinstance(t, sympy.Symbol) else ""): int(c)
             for t, c in e.as_coefficients_dict().items()}
    return terms.get("", 0), tuple(terms.get(a, 0) for a in axes)


def _evaluate(op: Operator, extents: Mapping[str, int],
              gather: _Gather) -> dict[tuple[int, ...], sympy.Expr]:
    """The output of ``op`` on symbolic tensors (entry ``A[0,2]`` is the symbol ``A_0_2``), each
    access reading through ``gather``; keyed by the output index."""
    dims = [[_affine(e, op.axes) for e in acc.indices] for acc in op.inputs]
    symbols: dict[tuple[str, tuple[int, ...]], sympy.Symbol] = {}
    terms: dict[tuple[int, ...], list[sympy.Expr]] = {}
    n_spatial = len(op.spatial_axes)
    for point in itertools.product(*(range(extents[a]) for a in op.axes)):
        factors = []
        for i, acc in enumerate(op.inputs):
            pos = []
            for d, (const, coefs) in enumerate(dims[i]):
                p = const + sum(c * v for c, v in zip(coefs, point))
                if (i, d) in gather:
                    low, n, kind = gather[i, d]
                    p = low + _moved(kind, p - low, n)
                pos.append(p)
            key = (acc.tensor, tuple(pos))
            if key not in symbols:
                symbols[key] = sympy.Symbol("_".join([acc.tensor, *map(str, pos)]), real=True)
            factors.append(symbols[key])
        terms.setdefault(point[:n_spatial], []).append(sympy.Mul(*factors))
    out = {}
    for key, ts in terms.items():
        if op.reducer == "none":
            (value,) = ts
        else:
            value = _SYMBOLIC_REDUCERS[op.reducer](*ts)
        out[key] = _SYMBOLIC_EPILOGUES[op.epilogue](value) if op.epilogue else value
    return out


def _gather(op: Operator, axis: str, extents: Mapping[str, int], kind: str) -> _Gather:
    """The gather that applies permutation ``kind`` along ``axis`` to every dimension it indexes."""
    sym = sympy.Symbol(axis, integer=True)
    gather: _Gather = {}
    for i, acc in enumerate(op.inputs):
        for d in acc.dims_of(axis):
            e = acc.indices[d]
            if e == sym:
                gather[i, d] = (0, extents[axis], kind)
                continue
            const, coefs = _affine(e, op.axes)
            spans = [c * (extents[a] - 1) for c, a in zip(coefs, op.axes)]
            low = min(0, const + sum(min(0, s) for s in spans))
            high = const + sum(max(0, s) for s in spans) + 1  # one spare position
            gather[i, d] = (low, high - low + 1, kind)
    return gather


def _same(a: sympy.Expr, b: sympy.Expr) -> bool:
    return a == b or sympy.expand(a - b) == 0


def _csv(values: tuple[int, ...]) -> str:
    return ",".join(map(str, values))


def _check_extents(op: Operator, axis: str) -> dict[str, int]:
    """Extents of the symbolic check of ``axis``: CHECK_EXTENT for it, OTHER_EXTENT for the
    axes sharing an access with it, 1 for the rest; RuleError past MAX_SHARING_AXES."""
    sharing = {a for acc in op.accesses_of(axis) for a in acc.axes} - {axis}
    if len(sharing) > MAX_SHARING_AXES:
        raise RuleError(
            f"axis {axis} of {op.text!r} shares an access with {len(sharing)} other axes; the "
            f"symbolic check of the PIT rules handles at most {MAX_SHARING_AXES} "
            f"({CHECK_EXTENT}*{OTHER_EXTENT}^{MAX_SHARING_AXES} points): give the tensors fewer "
            f"dimensions (merge axes that are always used together)")
    return {a: CHECK_EXTENT if a == axis else OTHER_EXTENT if a in sharing else 1
            for a in op.axes}


def _symbolic(op: Operator, axis: str) -> tuple[bool, str]:
    """Evaluate ``op`` with ``axis`` permuted; (invariant?, what was observed)."""
    extents = _check_extents(op, axis)
    base = _evaluate(op, extents, {})
    out_dim = op.output.axes.index(axis) if axis in op.output.axes else None
    out = op.output.tensor
    seen = []
    for kind in PERMUTATIONS:
        perm = PERMUTATIONS[kind](CHECK_EXTENT)
        shown = f"{kind} ({' '.join(map(str, perm))}) of {axis}"
        permuted = _evaluate(op, extents, _gather(op, axis, extents, kind))
        for key, value in permuted.items():
            want = key
            if out_dim is not None:
                want = key[:out_dim] + (perm[key[out_dim]],) + key[out_dim + 1:]
            if not _same(value, base[want]):
                moved = "" if want == key else f" instead of matching {out}[{_csv(want)}]"
                return False, f"under the {shown}, {out}[{_csv(key)}] changes{moved}: not invariant"
        seen.append(shown)
    effect = (f"{out} permuted the same way along {axis}" if out_dim is not None
              else f"{out} unchanged")
    return True, (f"{' and '.join(seen)} (extent {CHECK_EXTENT}, axes sharing an access "
                  f"{OTHER_EXTENT}, others 1) leave {effect}")


def _rule(op: Operator, axis: str) -> AxisRule:
    rule = _structural(op, axis)
    invariant, observed = _symbolic(op, axis)
    if invariant != rule.invariant:
        raise RuleError(
            f"internal inconsistency in the PIT rules of {op.text!r}, axis {axis}: the structural "
            f"rule says {'' if rule.invariant else 'not '}invariant ({rule.reason}) but symbolic "
            f"evaluation says {'' if invariant else 'not '}invariant ({observed}); this is a bug "
            f"in pitgen")
    return AxisRule(rule.axis, rule.role, rule.invariant, rule.needs, rule.reason, observed)


def analyse(op: Operator | str) -> Rules:
    """Derive the PIT rule of every loop axis of ``op``, each confirmed by symbolic evaluation.
    Remembered per expression text: the symbolic checks run once per process, however many
    plans, operators and calls ask (so the result is shared: read it, never mutate it)."""
    return _analyse(as_operator(op).text)


@cache.lru("rules.analyse", maxsize=1024)
def _analyse(text: str) -> Rules:
    op = parse(text)
    return Rules(op, {a: _rule(op, a) for a in op.axes})
