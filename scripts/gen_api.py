"""Write the API reference (docs/api.md) from the docstrings of pitgen's public modules.

    python scripts/gen_api.py [--out docs/api.md]

Public names are a module's ``__all__``, else the names not starting with ``_`` that the module
itself defines. Signatures and docstrings are read from the source (the abstract syntax tree),
not from live objects, so the page is the same with or without torch: names that need torch
are built on first use (``pitgen.nn``, ``SparseLinear``) and are found by name in pitgen's
sources instead.
"""
from __future__ import annotations

import argparse
import ast
import copy
import importlib
import inspect
import pkgutil
import sys
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any

PACKAGES = ("pitgen.ops", "pitgen.graph")  # every module inside is public
MODULES = ("pitgen", "pitgen.graphs", "pitgen.nn", "pitgen.bench")
OPTIONAL = ("pitgen.reference", "pitgen.testing")  # documented when present
Definition = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


def module_names() -> list[str]:
    """The modules the page documents, in page order."""
    names = [MODULES[0]]
    for pkg in PACKAGES:
        path = importlib.import_module(pkg).__path__
        names += [f"{pkg}.{m.name}" for m in pkgutil.iter_modules(path)
                  if not m.name.startswith("_")]
    names += MODULES[1:]
    return names + [m for m in OPTIONAL if importlib.util.find_spec(m) is not None]


@lru_cache(maxsize=None)
def tree(path: str) -> ast.Module:
    return ast.parse(Path(path).read_text())


def pitgen_sources() -> list[str]:
    import pitgen

    return sorted(str(p) for p in Path(pitgen.__file__).parent.rglob("*.py"))


@lru_cache(maxsize=None)
def definitions(path: str) -> dict[str, Definition]:
    """Each name's first definition in the file, top level first (ast.walk is breadth-first),
    indexed once per file (walking every file per name took seconds)."""
    out: dict[str, Definition] = {}
    for n in ast.walk(tree(path)):
        if isinstance(n, Definition):
            out.setdefault(n.name, n)
    return out


def find(name: str, paths: list[str]) -> tuple[Definition, str] | None:
    """The definition of ``name`` (top level first, then nested) in the first file holding one."""
    for path in paths:
        hit = definitions(path).get(name)
        if hit is not None:
            return hit, path
    return None


def paragraph(doc: str | None) -> str:
    """The first paragraph of a docstring, on one line."""
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def signature(node: Definition) -> str:
    """``(args) -> ret`` of a function; a class's constructor arguments: its ``__init__``'s, or
    its fields when a dataclass or NamedTuple makes the constructor."""
    if not isinstance(node, ast.ClassDef):
        ret = f" -> {ast.unparse(node.returns)}" if node.returns else ""
        return f"({ast.unparse(node.args)}){ret}"
    init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"),
                None)
    if init:
        args = copy.copy(init.args)  # the tree is cached: never edit it
        args.args = args.args[1:]  # self
        return f"({ast.unparse(args)})"
    made = [ast.unparse(d) for d in node.decorator_list] + [ast.unparse(b) for b in node.bases]
    if not any("dataclass" in m or "NamedTuple" in m for m in made):
        return ""
    fields = [ast.unparse(n).replace(" = ", "=") for n in node.body
              if isinstance(n, ast.AnnAssign) and "ClassVar" not in ast.unparse(n.annotation)]
    return f"({', '.join(fields)})"


def constant(module: ModuleType, name: str, path: str | None) -> tuple[str, str]:
    """(value, the ``#:`` comment above its assignment) of a module-level name."""
    value = getattr(module, name, None)
    simple = isinstance(value, (str, int, float, tuple, frozenset))
    text = repr(value) if simple else type(value).__name__
    doc = ""
    if path:
        lines = Path(path).read_text().splitlines()
        for n in tree(path).body:
            targets = n.targets if isinstance(n, ast.Assign) else [getattr(n, "target", None)]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                i = n.lineno - 2  # the line above, 0-based
                while i >= 0 and lines[i].strip().startswith("#:"):
                    i -= 1
                doc = paragraph(" ".join(ln.strip()[2:] for ln in lines[i + 1:n.lineno - 1]))
    return (text if len(text) <= 80 else text[:77] + "..."), doc


#: Public names kept out of a module's __all__ (``from pitgen import *`` keeps the builtin).
UNSTARRED = {"pitgen": ("compile",)}


def public_names(module: ModuleType, path: str | None) -> list[str]:
    if hasattr(module, "__all__"):
        return [*UNSTARRED.get(module.__name__, ()), *module.__all__]
    names: list[str] = []
    for n in tree(path).body if path else []:
        if isinstance(n, Definition):
            names.append(n.name)
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            names += [t.id for t in targets if isinstance(t, ast.Name)]
    return [n for n in dict.fromkeys(names) if not n.startswith("_")]


def entry(mod: str, module: ModuleType, name: str, path: str | None) -> list[str]:
    """One name's lines: its signature and the first paragraph of its docstring."""
    try:
        obj: Any = getattr(module, name)
    except (ImportError, AttributeError):  # built on first use, and that needs torch
        obj = None
    home = getattr(obj, "__module__", None) if callable(obj) else None
    if obj is not None and not callable(obj):
        value, doc = constant(module, name, path)
        return [f"- `{mod}.{name}` = `{value}`" + (f": {doc}" if doc else "")]
    real = getattr(obj, "__name__", name)
    where = [inspect.getsourcefile(sys.modules[home])] if home in sys.modules else []
    hit = find(real, where + ([path] if path else []) + pitgen_sources())
    if hit is None:
        return [f"- `{mod}.{name}`"]
    node, _ = hit
    kind = "class " if isinstance(node, ast.ClassDef) else ""
    alias = f" (`{home}.{real}`)" if real != name and home else ""
    doc = paragraph(ast.get_docstring(node))
    bases = ", ".join(f"`{ast.unparse(b)}`" for b in getattr(node, "bases", []))
    doc = " ".join(t for t in (f"Bases: {bases}." if bases else "", doc) if t)
    return [f"### `{kind}{mod}.{name}{signature(node)}`{alias}", ""] + ([doc, ""] if doc else [])


def render() -> str:
    names = module_names()
    lines = ["# API reference", "",
             "Generated from the docstrings by `python scripts/gen_api.py`; do not edit by hand.",
             "Each entry: the signature and the first paragraph of the docstring.", ""]
    lines += [f"- [`{m}`](#{m.replace('.', '')})" for m in names] + [""]
    for mod in names:
        module = importlib.import_module(mod)
        path = getattr(module, "__file__", None)
        lines += [f"## {mod}", "", paragraph(module.__doc__), ""]
        consts: list[str] = []
        for name in public_names(module, path):
            e = entry(mod, module, name, path)
            (consts if e[0].startswith("- ") else lines).extend(e)
        if consts:
            lines += consts + [""]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/api.md", help="file to write (default docs/api.md)")
    args = ap.parse_args(argv)
    Path(args.out).write_text(render())
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
