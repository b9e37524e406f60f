"""The exceptions pitgen raises: one base class, one subclass per stage that can refuse."""
from __future__ import annotations


class PitgenError(Exception):
    """Base of every error pitgen raises on purpose."""


class ExpressionError(PitgenError, ValueError):
    """A tensor expression that does not parse or does not make sense.

    ``column`` is 1-based; ``str(err)`` shows the expression with a caret under it.
    """

    def __init__(self, message: str, text: str = "", column: int | None = None):
        self.message = message
        self.text = text
        self.column = column
        if text and column is not None:
            # a window of the text around the column: a long expression stays one short line
            lo = max(0, column - 1 - 60)
            shown = ("..." if lo else "") + text[lo:column - 1 + 60] + (
                "..." if column - 1 + 60 < len(text) else "")
            caret = " " * (column - 1 - lo + (3 if lo else 0)) + "^"
            full = f"{message} (column {column})\n  {shown}\n  {caret}"
        else:
            full = message
        super().__init__(full)


class RuleError(PitgenError, ValueError):
    """A request that contradicts the PIT rules (e.g. a micro-tile along a non-invariant axis),
    or a symbolic check that disagrees with the structural rule (a bug: fails loudly)."""


class PlanError(PitgenError, ValueError):
    """A plan that cannot be made: unknown operand, bad tile, mask of the wrong shape."""


class ShapeError(PitgenError, ValueError):
    """Arrays whose shapes, dtypes or layouts do not fit the operator or plan."""


class CompileError(PitgenError, RuntimeError):
    """nvcc (or the template renderer) failed; the message carries the compiler log."""


class DeviceError(PitgenError, RuntimeError):
    """No usable CUDA device, pycuda missing, or a tensor on the wrong device."""


class FileError(PitgenError, OSError):
    """A file or directory given to pitgen that cannot be read or written (the OS's reason
    included), or whose content is not what was asked for."""


class DependencyError(PitgenError, ImportError):
    """An optional package that this call needs is not installed (the message says which extra
    brings it)."""


class BackwardError(PitgenError, RuntimeError):
    """An operator without a backward called on inputs that require grad while grad mode is on
    (the message names the operator): its result would have no grad path."""


class PitgenWarning(UserWarning):
    """Base of every warning pitgen emits on purpose (filter it with ``warnings``)."""


class FormatWarning(PitgenWarning):
    """An explicitly requested sparse format that the cost model (pitgen.graph.model) expects
    to be many times slower than another on this graph; the message names the better one."""
