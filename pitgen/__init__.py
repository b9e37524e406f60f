"""pitgen: CUDA kernels for dynamically sparse operators via PIT (permutation invariant
transformation). Data flows one way: expression -> rules -> plan -> rendered source ->
compiled module -> launch."""
from .version import __version__

from .errors import (CompileError, DeviceError, ExpressionError, PitgenError, PlanError,  # noqa: E402
                     RuleError, ShapeError)
from .expr import Access, Operator, parse  # noqa: E402
from .rules import AxisRule, Rules, analyse  # noqa: E402
from .planner import Candidate, Plan, make_plan as plan  # noqa: E402
from .index import TileIndex, build_index  # noqa: E402
from .executor import evaluate, execute  # noqa: E402
from .ops.matmul import SparseKernel, compile  # noqa: E402

__all__ = [
    "parse", "analyse", "plan", "build_index", "execute", "evaluate", "compile",
    "Operator", "Access", "Rules", "AxisRule", "Plan", "Candidate", "TileIndex", "SparseKernel",
    "PitgenError", "ExpressionError", "RuleError", "PlanError", "ShapeError", "CompileError",
    "DeviceError", "__version__",
]
