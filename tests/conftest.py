"""Hypothesis settings for the test suite: no deadline (sympy's first calls are slow), few
examples so the whole suite stays fast on small CI machines; GPU tests skip with the reason."""
from __future__ import annotations

from hypothesis import settings

settings.register_profile("ci", deadline=None, max_examples=30)
settings.load_profile("ci")


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


def pytest_collection_modifyitems(config, items):
    gpu = [item for item in items if "gpu" in item.keywords]
    reason = _gpu_missing() if gpu else None
    if reason:
        import pytest

        for item in gpu:
            item.add_marker(pytest.mark.skip(reason=f"GPU test skipped: {reason}"))
