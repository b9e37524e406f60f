"""pitgen: CUDA kernels for dynamically sparse operators via PIT (permutation invariant
transformation). Data flows one way: expression -> rules -> plan -> rendered source ->
compiled module -> launch."""
from .errors import (CompileError, DeviceError, ExpressionError, PitgenError, PlanError,
                     RuleError, ShapeError)
from .expr import Access, Operator, parse
from .rules import AxisRule, Rules, analyse

__version__ = "0.1.0"

__all__ = [
    "parse", "analyse",
    "Operator", "Access", "Rules", "AxisRule",
    "PitgenError", "ExpressionError", "RuleError", "PlanError", "ShapeError", "CompileError",
    "DeviceError", "__version__",
]
