"""The CPU examples run as a user runs them (a fresh interpreter, from outside the repo) and
print what they promise."""
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("script, line", [
    ("rules_and_plan.py", "choice: micro 32x1 along k (waste 0.00); max error vs NumPy"),
    ("emit_kernel.py", "  cudaError_t pit_matmul_a_f16_k32x1_sm80_build_and_run(const void* A,"),
])
def test_cpu_example_runs(tmp_path, script, line):
    proc = subprocess.run([sys.executable, str(EXAMPLES / script)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert any(ln.startswith(line) for ln in proc.stdout.splitlines()), proc.stdout
