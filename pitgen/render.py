"""Rendering: a template name and its context -> CUDA C++ source, through the Jinja templates
shipped in ``pitgen.templates`` (the repository's ``templates/`` folder, which a source
checkout without an install reads in place)."""
from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import Any

import jinja2

from . import cache
from .errors import CompileError
from .version import __version__


def template_dir() -> Path:
    """Where the templates are: the installed ``pitgen.templates`` package, else the checkout's
    ``templates/`` beside the ``pitgen/`` folder."""
    try:
        return Path(str(files("pitgen.templates")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[1] / "templates"


@cache.lru("render.environment", maxsize=1)
def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())),
        undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
        trim_blocks=False, lstrip_blocks=False)


def render_template(template: str, /, **ctx: Any) -> str:
    """CUDA source of ``template`` rendered with ``ctx``."""
    try:
        return environment().get_template(template).render(version=__version__, **ctx)
    except jinja2.TemplateError as e:  # a template bug, never user input: say where
        raise CompileError(f"template error while rendering {template}: {e}") from e
