"""CPU tests of the documentation: the API reference generator runs without torch, and the docs
index lists every document."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_api_reference_generates_without_torch(tmp_path):
    out = tmp_path / "api.md"
    code = ("import runpy, sys; sys.modules['torch'] = None; "  # import torch fails
            f"sys.argv = ['gen_api.py', '--out', {str(out)!r}]; "
            "runpy.run_path('scripts/gen_api.py', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert "### `pitgen.compile(" in text and "### `pitgen.analyse(" in text
    assert "## pitgen.ops.attention" in text and "## pitgen.bench" in text
    assert "class pitgen.nn.SparseLinear(" in text  # built on first use, found in the source


def test_index_lists_every_document():
    index = (ROOT / "docs" / "index.md").read_text()
    docs = [p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").glob("*.md")]
    assert [d for d in docs if d != "index.md" and f"({d})" not in index] == []
