"""The comparison every GPU test makes: no NaN (an unwritten, poisoned element or a bad read),
the reference's shape, and a relative-norm error within the dtype's bound (exact zeros when the
reference is zero)."""
from __future__ import annotations

import numpy as np


def assert_close(out, ref: np.ndarray, tol: float) -> None:
    got = out.detach().double().cpu().numpy()
    assert got.shape == ref.shape
    assert not np.isnan(got).any(), "NaN in the output (unwritten element or bad read)"
    norm = np.linalg.norm(ref)
    if norm == 0:
        assert np.count_nonzero(got) == 0
        return
    err = np.linalg.norm(got - ref) / norm
    assert err <= tol, f"relative error {err:.3g} > {tol}"
