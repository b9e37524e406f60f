"""pytest with a time limit that stops it as Ctrl-C does: the tests that finished still get
their summary and Hypothesis statistics (a killed pytest prints neither, and under xdist a
signal to the whole process group loses the workers' reports).

    python3 scripts/pytest_within.py SECONDS [pytest arguments...]"""
from __future__ import annotations

import signal
import sys

import pytest


def _stop(*_: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str]) -> int:
    if not argv or not argv[0].isdigit():
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    # also undo SIG_IGN, which a shell's background job inherits for SIGINT
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGALRM, _stop)
    signal.alarm(int(argv[0]))
    return int(pytest.main(argv[1:]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
