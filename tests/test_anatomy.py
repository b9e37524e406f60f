"""The package's shape: one operator anatomy (every GPU operator an OpSpec whose permutations
the rule engine derives), a runtime that only loads and launches, and no import circles."""
from __future__ import annotations

import ast
import functools
import importlib
import pkgutil
from pathlib import Path

import pytest

import pitgen
from pitgen.opspec import OPERATORS, OpSpec, Permutation
from pitgen.render import template_dir

PACKAGE = Path(pitgen.__file__).parent


def _modules() -> dict[str, Path]:
    mods = {}
    for p in PACKAGE.rglob("*.py"):
        parts = p.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = p
    return mods


@functools.cache
def _imports() -> dict[str, set[str]]:
    """Module -> the pitgen modules it imports at import time (relative imports, outside
    ``if TYPE_CHECKING``); parsed once, for the tests that read it."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rsplit(".", 1)[0]
        tree = ast.parse(p.read_text())
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        edges = set()
        for node in ast.walk(tree):
            if id(node) in typing_only or not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            base = pkg.split(".")[:len(pkg.split(".")) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
            subs = {f"{target}.{a.name}" for a in node.names} & mods.keys()
            edges |= subs or ({target} & mods.keys())
        graph[m] = edges - {m}
    return graph


def test_no_import_circles_and_no_import_of_the_package_itself():
    graph = _imports()
    assert not [m for m, ts in graph.items() if "pitgen" in ts]
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in graph[m]:
            assert state.get(t) != 1, f"import circle: {' -> '.join(path + [t])}"
            if t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [m])


def test_runtime_only_loads_and_launches():
    assert _imports()["pitgen.runtime"] <= {"pitgen.cache", "pitgen.compiler",
                                                      "pitgen.errors"}


def _all_operators() -> dict[str, OpSpec]:
    for sub in ("pitgen.ops", "pitgen.graph"):
        for info in pkgutil.iter_modules(importlib.import_module(sub).__path__):
            importlib.import_module(f"{sub}.{info.name}")
    return OPERATORS


def test_every_gpu_operator_declares_the_anatomy():
    ops = _all_operators()
    assert {"matmul", "moe", "attention", "sddmm", "spmm", "hyb spmm", "graph sddmm",
            "convert"} <= set(ops)
    for spec in ops.values():
        assert (template_dir() / spec.template).is_file(), spec.name
        assert spec.kernels and spec.dtypes, spec.name
        assert all(set(sig) <= set("PiqfdlLM") for sig in spec.kernels.values()), spec.name
        derived = spec.derive()
        assert list(derived) == [p.name for p in spec.permutes]
        assert all(derived.values()), spec.name
    # the axes come from the rule engine, e.g.:
    assert ops["attention"].derive() == {"query blocks": ("b", "h", "i"), "key blocks": ("j",)}
    assert ops["moe"].derive() == {"tokens in": ("t",), "tokens out": ("t",)}


def test_a_kernel_permuting_a_non_invariant_axis_cannot_be_declared_into_use():
    conv = OpSpec("test: conv rows", "attention.cu.j2", {"k": "P"},
                  (Permutation("output rows", "O[y] += I[y+r] * W[r]", "spatial", "I"),),
                  ("float16",))
    with pytest.raises(pitgen.RuleError, match="not permutation invariant"):
        conv.derive()
    none = OpSpec("test: no reduction", "attention.cu.j2", {"k": "P"},
                  (Permutation("sum", "C[m,n] += A[m,n] * B[m,n]", "reduction", "A"),), ("float16",))
    with pytest.raises(pitgen.RuleError, match="no reduction axis"):
        none.derive()


def test_cache_inventory_and_clear():
    pitgen.analyse("C[m,n] += A[m,k] * B[k,n]")
    assert pitgen.cache.inventory()["rules.analyse"] >= 1
    pitgen.cache.clear()
    assert pitgen.cache.inventory()["rules.analyse"] == 0
