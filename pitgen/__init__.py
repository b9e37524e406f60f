"""pitgen: CUDA kernels for dynamically sparse operators via PIT (permutation invariant
transformation). Data flows one way: expression -> rules -> plan -> rendered source ->
compiled module -> launch."""
from . import cache
from .errors import (CompileError, DependencyError, DeviceError, ExpressionError, FileError,
                     PitgenError, PlanError, RuleError, ShapeError)
from .executor import evaluate, execute
from .expr import Access, Operator, parse
from .index import TileIndex, build_index
from .ops.matmul import SparseKernel, compile  # noqa: F401  (pitgen.compile, not in __all__)
from .planner import Candidate, Plan, make_plan as plan
from .rules import AxisRule, Rules, analyse
from .version import __version__

# ``compile`` is left out of __all__ so that ``from pitgen import *`` keeps the builtin.
__all__ = [
    "parse", "analyse", "plan", "build_index", "execute", "evaluate",
    "Operator", "Access", "Rules", "AxisRule", "Plan", "Candidate", "TileIndex", "SparseKernel",
    "PitgenError", "ExpressionError", "RuleError", "PlanError", "ShapeError", "CompileError",
    "DeviceError", "FileError", "DependencyError", "cache", "__version__",
]
