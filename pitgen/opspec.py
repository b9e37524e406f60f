"""The anatomy every GPU operator shares, declared once per operator as an :class:`OpSpec`.

An operator is: the expressions it computes; the permutations its kernels perform, each named
by a role and an operand, whose axes the rule engine derives (``analyse``: a kernel can only be
planned when every such axis is permutation invariant); the template and its kernels' argument
signatures; the dtypes it runs. Each operator's plan fixes a template context, and one path
turns it into a launchable module: :meth:`OpSpec.module` renders the template, compiles it
(on-disk cache) and loads it (:func:`pitgen.runtime.load`).

matmul (the JIT :func:`pitgen.compile`), MoE, attention, SDDMM, the graph SpMM/SDDMM and the
format conversions all go through here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from . import cache
from .errors import RuleError, ShapeError
from .render import render_template
from .rules import Rules, analyse
from .runtime import Module, device_index, load

ROLES = ("spatial", "reduction")


@dataclass(frozen=True)
class Permutation:
    """What a kernel reorders: the ``role`` axes of ``expr`` that index ``operand`` (e.g. the
    spatial axes of Q in the attention scores: the (batch, head, query) blocks a CTA takes in
    any order). ``name`` says what the kernel does with them."""

    name: str
    expr: str
    role: str
    operand: str
    #: the axes moved, when only some of the operand's ``role`` axes are (a convolution gathers
    #: its channels c, not the window's r and s); empty: all of them
    only: tuple[str, ...] = ()

    def axes(self, rules: Rules) -> tuple[str, ...]:
        """The axes this permutation moves, from ``rules``; RuleError when one is not invariant
        or none matches (the kernel would rely on a rule the engine does not give)."""
        if self.role not in ROLES:
            raise RuleError(f"{self.name}: role {self.role!r} is not one of {ROLES}")
        op = rules.operator
        indexed = op.access(self.operand).axes
        axes = tuple(a for a in indexed if a in rules.axes and rules.axes[a].role == self.role
                     and (not self.only or a in self.only))
        if not axes:
            raise RuleError(f"{self.name}: {self.operand} has no {self.role} axis in "
                            f"{op.text!r}")
        for a in axes:
            rules.require_invariant(a)
        return axes


_DERIVED = cache.memo("opspec.derived")
_MODULES = cache.memo("opspec.modules")
#: (operator, plan) -> module, for operators whose plans are hashable (frozen dataclasses)
_PLAN_MODULES = cache.memo("opspec.plan_modules")
#: Every OpSpec by name, as its module declares it (the manifest of GPU operators).
OPERATORS: dict[str, "OpSpec"] = {}


@dataclass(frozen=True)
class OpSpec:
    """One GPU operator: template, kernel signatures (PyCUDA ``prepare`` strings, in the order
    of each kernel's parameters), the permutations its kernels rely on, and its dtypes."""

    name: str
    template: str
    kernels: Mapping[str, str]
    permutes: tuple[Permutation, ...] = ()
    dtypes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if OPERATORS.setdefault(self.name, self) != self:
            raise RuleError(f"two different operators are named {self.name!r}")

    def derive(self) -> dict[str, tuple[str, ...]]:
        """Permutation name -> the axes it moves, derived through the rule engine once per
        process; RuleError naming the axis and the rule's reason otherwise."""
        hit = _DERIVED.get(self.name)
        if hit is None:
            hit = _DERIVED[self.name] = {p.name: p.axes(analyse(p.expr)) for p in self.permutes}
        return hit

    def check_dtype(self, dtype: str) -> str:
        """``dtype`` if this operator runs it, else ShapeError listing the ones it does."""
        if dtype not in self.dtypes:
            raise ShapeError(f"dtype {dtype} is not supported by {self.name}; expected "
                             f"{' or '.join(self.dtypes)}")
        return dtype

    def source(self, ctx: Mapping[str, Any]) -> str:
        """CUDA source of this operator for the template context ``ctx``."""
        self.derive()
        return render_template(self.template, **ctx)

    def module(self, ctx: Mapping[str, Any] | Any) -> Module:
        """The loaded module for ``ctx`` on the current device: a template context, or a
        hashable plan whose ``context()`` gives it. A plan seen before returns at once (one
        dictionary lookup: operators call this on every launch); contexts that render alike
        share one module."""
        if not isinstance(ctx, Mapping):
            key = (self.name, ctx, device_index())
            mod = _PLAN_MODULES.get(key)
            if mod is None:
                mod = _PLAN_MODULES[key] = self.module(ctx.context())
            return mod
        try:  # scalar contexts key by their items; nested ones (lists, dicts) by their repr
            config: tuple = (self.name, tuple(sorted(ctx.items())), device_index())
            mod = _MODULES.get(config)
        except TypeError:
            config = (self.name, repr(sorted(ctx.items())), device_index())
            mod = _MODULES.get(config)
        if mod is None:
            mod = _MODULES[config] = load(self.source(ctx), self.kernels)
        return mod
