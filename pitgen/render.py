"""Rendering: a :class:`~pitgen.lower.ModuleSpec` -> CUDA C++ source, through the Jinja templates
shipped in ``pitgen.templates`` (the repository's ``templates/`` folder)."""
from __future__ import annotations

from dataclasses import asdict
from functools import lru_cache
from importlib.resources import files

import jinja2

from .version import __version__
from .lower import ModuleSpec


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(files("pitgen.templates"))),
        undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
        trim_blocks=False, lstrip_blocks=False)


def render_template(name: str, **ctx) -> str:
    """CUDA source of template ``name`` rendered with ``ctx``: the entry point of the operators
    beyond the GEMM module (attention, MoE, sparse formats), whose lowering builds ``ctx``."""
    try:
        return environment().get_template(name).render(version=__version__, **ctx)
    except jinja2.TemplateError as e:  # a template bug, never user input: say where
        from .errors import CompileError
        raise CompileError(f"template error while rendering {name}: {e}") from e


def render(spec: ModuleSpec) -> str:
    """CUDA source of one module: index builder, tile kernel and SWrite passes for ``spec``."""
    ctx = asdict(spec)
    ctx["version"] = __version__
    try:
        return environment().get_template("module.cu.j2").render(**ctx)
    except jinja2.TemplateError as e:  # a template bug, never user input: say where
        from .errors import CompileError
        raise CompileError(f"template error while rendering {spec.key}: {e}") from e
