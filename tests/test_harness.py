"""The error-contract harness of tests/test_errors.py can fail: its fuzz loop stops an input
that hangs (the time bound fires) and fails an input that raises anything but a PitgenError,
naming the input; success and PitgenErrors pass."""
from __future__ import annotations

import time

import pytest
import test_errors as E

import pitgen


def test_an_input_that_hangs_is_stopped():
    start = time.monotonic()
    with pytest.raises(E.Hang, match="sleeper took more than 0.2 s"):
        with E.bounded(0.2, "sleeper"):
            time.sleep(5)
    assert time.monotonic() - start < 2


def test_outcome_takes_success_and_pitgen_errors_only(monkeypatch):
    def refused():
        raise pitgen.ShapeError("x has the wrong shape")

    assert E.outcome(lambda: None, "seed 1") == "ok"
    assert E.outcome(refused, "seed 2") == "ShapeError"
    with pytest.raises(AssertionError, match="seed 3: raised ValueError"):
        E.outcome(lambda: int("x"), "seed 3")
    with pytest.raises(AssertionError, match="seed 4: raised RecursionError"):
        E.outcome(lambda: (_ for _ in ()).throw(RecursionError("deep")), "seed 4")
    monkeypatch.setattr(E, "INPUT_SECONDS", 0.2)
    with pytest.raises(E.Hang, match="seed 5"):
        E.outcome(lambda: time.sleep(5), "seed 5")
