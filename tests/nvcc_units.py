"""Compile units of the CPU suite: several rendered sources in one translation unit, so that one
nvcc run parses CUDA's headers once for all of them (half a second of every small compile, and
the suite compiles a hundred sources).

In a unit (``unit.cu.j2``) each source keeps what it has alone: its own namespace, its kernels
(renamed: ``extern "C"`` names are global), its macros (undefined after it), and exactly its
headers: a unit holds sources that include the same ones, included once at its top (so a
source sees them from its first line on, not from its own ``#include`` lines). Where that is
not enough, the unit fails to compile and each of its sources is compiled alone: a source
passes or fails exactly as it would alone. A unit's cubin must hold every renamed kernel.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple

import jinja2

from pitgen import compiler
from pitgen.errors import CompileError

INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*([<"][^>"\n]+[>"])', re.M)
DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)", re.M)
EXTERN_C = re.compile(r'\bextern[ \t]+"C"')
KERNEL = re.compile(r'\bextern[ \t]+"C"[ \t]+__global__[ \t]+void[ \t]+'
                    r"(?:__launch_bounds__[ \t]*\([^)]*\)\s*)?(\w+)[ \t]*\(")
#: Sources per unit, and characters: large enough to save most of the per-run cost, small
#: enough that the units keep every worker busy to the end.
MAX_SOURCES = 8
MAX_CHARS = 160_000


class Part(NamedTuple):
    source: str
    kernels: list[str]
    macros: list[str]


def headers(source: str) -> tuple[str, ...]:
    """The headers ``source`` includes, sorted: sources share a unit only with equal ones."""
    return tuple(sorted(set(INCLUDE.findall(source))))


def fits(source: str) -> bool:
    """Whether ``source`` can share a unit: every ``extern "C"`` name is a kernel found here."""
    return len(KERNEL.findall(source)) == len(EXTERN_C.findall(source))


def plan(sources: Iterable[str]) -> list[list[str]]:
    """The units of ``sources`` (those that fit, by headers, in order), largest first; each
    source that cannot share a unit is a unit of its own."""
    groups: dict[tuple[str, ...] | None, list[str]] = {}
    for src in dict.fromkeys(sources):
        groups.setdefault(headers(src) if fits(src) else None, []).append(src)
    units = [[src] for src in groups.pop(None, [])]
    for group in groups.values():
        units += _chunks(group)
    return sorted(units, key=lambda unit: -sum(map(len, unit)))


def _chunks(group: list[str]) -> Iterator[list[str]]:
    unit: list[str] = []
    for src in group:
        if unit and (len(unit) == MAX_SOURCES or sum(map(len, unit)) + len(src) > MAX_CHARS):
            yield unit
            unit = []
        unit.append(src)
    if unit:
        yield unit


def render(sources: list[str]) -> tuple[str, list[list[str]]]:
    """The unit's source, and each source's kernels as the unit names them."""
    parts = [Part(src, KERNEL.findall(src), DEFINE.findall(src)) for src in sources]
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(Path(__file__).parent)),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    text = env.get_template("unit.cu.j2").render(headers=headers(sources[0]), parts=parts)
    return text, [[f"{k}_unit{i}" for k in part.kernels] for i, part in enumerate(parts)]


def compile_unit(sources: tuple[str, ...], arch: str,
                 extra: tuple[str, ...] = ()) -> tuple[list[bytes | Exception], str | None]:
    """Each source's outcome (the unit's cubin, or the error of compiling it alone) and, when
    the unit failed although no source fails alone, nvcc's complaint about the unit."""
    if len(sources) > 1:
        text, kernels = render(list(sources))
        try:
            cubin = compiler.compile_source(text, arch, extra)
        except CompileError as e:
            unit_error = str(e)
        else:
            missing = [k for ks in kernels for k in ks
                       if not re.search(rb"[\0.]" + k.encode() + rb"\0", cubin)]
            if missing:
                raise CompileError(f"the unit's cubin lacks the kernels {missing}")
            return [cubin] * len(sources), None
    outcomes: list[bytes | Exception] = []
    for src in sources:
        try:
            outcomes.append(compiler.compile_source(src, arch, extra))
        except Exception as e:  # noqa: BLE001 - each source's own failure, for its own test
            outcomes.append(e)
    failed_alone = any(isinstance(o, Exception) for o in outcomes)
    return outcomes, None if len(sources) == 1 or failed_alone else unit_error
