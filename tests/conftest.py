"""Test-suite setup.

- Hypothesis: no deadline (sympy's first calls are slow), few derandomized examples so that the
  suite stays fast and repeatable on small CI machines; ``PITGEN_HYPOTHESIS=thorough`` selects
  the thorough profile (2000 examples per GPU property test, for a lent GPU).
- The compile cache: ``$PITGEN_CACHE`` when set, else pytest's cache folder (cold in a fresh CI
  clone, warm on local reruns), never the user's ``~/.cache/pitgen``: the compile workers are
  handed that folder explicitly, whatever a test does to the environment meanwhile.
- nvcc tests (marker ``nvcc``) skip with the reason where nvcc is missing, and run last: each of
  their modules may define ``nvcc_jobs(pool)``, which submits its compiles to one background
  pool of os.cpu_count() worker processes right after collection, so that nvcc runs while the
  CPU-only tests do; the tests then take the results (``nvcc`` fixture), module by module in
  the order their compiles are queued. Identical jobs run once. The ``compile_source`` jobs
  submitted at collection compile several sources per nvcc run (tests/nvcc_units.py: a job's
  result is its unit's cubin; a source that fails, fails with its own error), the largest
  units first. Processes, not threads: a thread starting nvcc while pytest sets
  PYTEST_CURRENT_TEST in os.environ can exec with a freed environment (EFAULT).
- GPU tests (marker ``gpu``) skip with the reason where torch, a device or pycuda is missing.
"""
from __future__ import annotations

import functools
import multiprocessing
import os
import tempfile
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable

import nvcc_units
import pytest
from hypothesis import settings

from pitgen import compiler

# The fast profile: derandomized (the same examples every run) and printing the blob that
# reproduces a failure; PITGEN_HYPOTHESIS=thorough: fresh random examples, >= 2000 per GPU
# property test (pitgen.testing.examples), the seed printed on failure.
settings.register_profile("ci", deadline=None, max_examples=30, derandomize=True,
                          print_blob=True)
settings.register_profile("thorough", deadline=None, max_examples=2000, print_blob=True)
settings.load_profile(os.environ.get("PITGEN_HYPOTHESIS") or "ci")


class NvccPool:
    """Background jobs (compiles: module-level functions of picklable, hashable arguments), each
    distinct one run once; a job asked for again gets the first one's future. The workers start
    with the first jobs, at collection, before any test changes the environment. Until
    :meth:`start_units`, ``compile_source`` jobs are held, to be compiled in units."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None
        self._jobs: dict[tuple, Future] = {}
        self._held: dict[tuple, dict[str, Future]] | None = {}  # (arch, extra) -> source -> job
        self._queued: dict[Future, int] = {}  # job -> where it (its unit) is in the queue
        self._tmp: tempfile.TemporaryDirectory | None = None
        #: units that failed although each of their sources compiles alone (nvcc's complaint)
        self.split_units: list[str] = []

    @property
    def tmp(self) -> Path:
        """A folder for job outputs that are files (object files), removed at the end."""
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="pitgen-nvcc-")
        return Path(self._tmp.name)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        key = (fn, *args)
        if key not in self._jobs:
            if fn is compiler.compile_source and self._held is not None:
                self._jobs[key] = self._hold(*args)
            else:
                self._jobs[key] = self._executor().submit(fn, *args)
                self._queued[self._jobs[key]] = len(self._queued)
        return self._jobs[key]

    def _hold(self, source: str, arch: str, extra: tuple[str, ...] = ()) -> Future:
        """``compile_source(source, arch, extra)``'s job, settled once its unit is compiled."""
        job: Future = Future()
        self._held.setdefault((arch, tuple(extra)), {})[source] = job
        return job

    def queued(self, job: Future) -> int:
        """Where ``job`` is in the pool's queue: the earlier, the sooner it is done."""
        return self._queued.get(job, len(self._queued))

    def start_units(self) -> None:
        """Compile the held jobs in units, the largest first (the last to finish are short);
        ``compile_source`` jobs submitted from now on run alone."""
        held, self._held = self._held or {}, None
        units = [(arch, extra, unit, jobs) for (arch, extra), jobs in held.items()
                 for unit in nvcc_units.plan(jobs)]
        for arch, extra, unit, jobs in sorted(units, key=lambda u: -sum(map(len, u[2]))):
            done = self._executor().submit(nvcc_units.compile_unit, tuple(unit), arch, extra)
            position = len(self._queued)
            self._queued.update({jobs[s]: position for s in unit})
            done.add_done_callback(functools.partial(self._settle, [jobs[s] for s in unit]))

    def _settle(self, jobs: list[Future], done: Future) -> None:
        try:
            outcomes, unit_error = done.result()
        except BaseException as e:  # noqa: BLE001 - the worker died or the pool shut down
            outcomes, unit_error = [e] * len(jobs), None
        for job, outcome in zip(jobs, outcomes):
            if isinstance(outcome, BaseException):
                job.set_exception(outcome)
            else:
                job.set_result(outcome)
        if unit_error:
            self.split_units.append(unit_error)

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(os.cpu_count() or 2,
                                             mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_use_cache,
                                             initargs=(os.environ["PITGEN_CACHE"],))
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
        if self._tmp is not None:
            self._tmp.cleanup()


def _use_cache(folder: str) -> None:
    """A compile worker's start: the session's cache folder, never the user's default."""
    os.environ["PITGEN_CACHE"] = folder


_POOL = NvccPool()


def pytest_configure(config: pytest.Config) -> None:
    if not os.environ.get("PITGEN_CACHE"):
        cache = getattr(config, "cache", None)
        folder = cache.mkdir("pitgen") if cache is not None else _POOL.tmp / "cache"
        os.environ["PITGEN_CACHE"] = str(folder)


def _nvcc_missing() -> str | None:
    """Why nvcc tests cannot run here, or None when they can."""
    from pitgen.compiler import find_nvcc
    from pitgen.errors import CompileError

    try:
        find_nvcc()
    except CompileError as e:
        return str(e)
    return None


def _gpu_missing() -> str | None:
    """Why GPU tests cannot run here, or None when they can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import pycuda.driver  # noqa: F401
    except ImportError:
        return "pycuda is not installed (pip install 'pitgen[cuda]')"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for marker, missing, what in (("gpu", _gpu_missing, "GPU"), ("nvcc", _nvcc_missing, "nvcc")):
        marked = [item for item in items if marker in item.keywords]
        reason = missing() if marked else None
        for item in marked if reason else ():
            item.add_marker(pytest.mark.skip(reason=f"{what} test skipped: {reason}"))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the selected nvcc tests' compiles (their modules' ``nvcc_jobs``), and order those
    tests by their modules' last compile in the queue: what a test does itself (linking, say)
    runs while the pool still compiles, not after it."""
    modules = {item.module: None for item in session.items
               if "nvcc" in item.keywords and not item.get_closest_marker("skip")}
    started: dict[Any, list[Future]] = {}
    for module in modules:
        jobs = getattr(module, "nvcc_jobs", None)
        try:
            if jobs is not None:
                futures = jobs(_POOL)
                started[module] = list(futures.values() if isinstance(futures, dict) else futures)
        except Exception:  # noqa: BLE001 - a variant that fails to render fails its own test,
            pass           # which calls nvcc_jobs again, rather than the whole session
    _POOL.start_units()
    last = {module: max(map(_POOL.queued, futures), default=-1)
            for module, futures in started.items()}
    session.items.sort(key=lambda item: last.get(item.module, -1) if "nvcc" in item.keywords
                       else -2)   # stable: the other tests first, as they were; nvcc tests last


def pytest_sessionfinish(session: pytest.Session) -> None:
    _POOL.close()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Units that compiled only source by source: the tests are right, the suite slower."""
    for error in _POOL.split_units:
        terminalreporter.write_line(f"nvcc unit split (each source compiles alone): {error}",
                                    yellow=True)


@pytest.fixture(scope="session")
def nvcc() -> NvccPool:
    """The background compile pool: ``nvcc.submit(fn, *args)`` gives the job's future."""
    return _POOL
