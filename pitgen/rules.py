"""The PIT rule engine: which loop axes of an operator are permutation invariant, and what a
kernel needs at run time to exploit that (SRead: gather; SWrite: scatter back)."""
from __future__ import annotations

from dataclasses import dataclass, field

import sympy

from .errors import RuleError
from .expr import Operator, parse

COMMUTATIVE_REDUCERS = ("sum", "max", "min")


@dataclass(frozen=True)
class AxisRule:
    axis: str
    role: str  # 'spatial' | 'reduction'
    invariant: bool
    needs: tuple[str, ...]  # subset of ('SRead', 'SWrite')
    reason: str

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
        lines = [f"PIT rules for {self.operator.text}"]
        for a, r in self.axes.items():
            verdict = "invariant" if r.invariant else "NOT invariant"
            needs = ", ".join(r.needs) if r.needs else "nothing"
            lines.append(f"  {a}: {r.role}, {verdict}; needs {needs}\n      {r.reason}")
        return "\n".join(lines)


def _structural(op: Operator, axis: str) -> AxisRule:
    role = "spatial" if axis in op.output.axes else "reduction"
    sym = sympy.Symbol(axis, integer=True)
    for acc in op.accesses_of(axis):
        for d in acc.dims_of(axis):
            e = acc.indices[d]
            if e != sym:
                return AxisRule(axis, role, False, (),
                                f"{acc.tensor} indexes dimension {d} by {e}: {axis} is coupled to "
                                f"other axes (or scaled), so permuting it moves other elements too")
    if role == "reduction" and op.reducer not in COMMUTATIVE_REDUCERS:
        return AxisRule(axis, role, False, (), f"reducer {op.reducer} is not commutative and associative")
    users = ", ".join(f"{a.tensor}[dim {a.dims_of(axis)[0]}]" for a in op.accesses_of(axis))
    if role == "reduction":
        return AxisRule(axis, role, True, ("SRead",),
                        f"{axis} is a bare index of {users} and {op.reducer} is commutative and "
                        f"associative: any order of {axis} gives the same output; gather the "
                        f"non-zero micro-tiles (SRead), nothing to scatter")
    return AxisRule(axis, role, True, ("SRead", "SWrite"),
                    f"{axis} is a bare index of {users}: output slice {axis}=i depends only on the "
                    f"inputs' slices {axis}=i, so slices can be computed in any order (SRead) and "
                    f"written back to their own positions (SWrite)")


def analyse(op: Operator | str) -> Rules:
    """Derive the PIT rule of every loop axis of ``op``."""
    if isinstance(op, str):
        op = parse(op)
    return Rules(op, {a: _structural(op, a) for a in op.axes})
