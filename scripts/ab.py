"""The A/B driver of scripts/ab_attention.py and scripts/ab_moe.py: a child script run in each
copy of the package, each in its own process, the copies alternating round by round (so that a
drift of the lent GPU's clocks or of its host falls on every copy alike). A copy is a directory
holding ``pitgen/`` and ``templates/``; its child runs in that directory, which leads the import
path, and its templates are the copy's own (``PREAMBLE``: an editable install of the package,
as ``device_session.sh`` makes, would otherwise serve ``pitgen.templates`` from the checkout);
it prints one line ``RESULT <json of {case: row}>``."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any, Callable


#: Run before each child: the copy's templates, whatever ``pitgen.templates`` resolves to.
PREAMBLE = """
import sys as _sys
from pathlib import Path as _Path
import pitgen.render as _render
_render.template_dir = lambda: _Path(_sys.argv[1]) / "templates"
"""


def main(child: str, show: Callable[[str, Any], str], doc: str,
         argv: list[str] | None = None) -> int:
    """Parse ``trees [--rounds] [--repeats]``, run ``child`` (argv: tree, repeats) per tree and
    round, and print ``show(case, row)`` for every case of each result; 1 if a child failed."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("trees", nargs="+", help="package copies (directories with pitgen/)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args(argv)
    trees = [os.path.abspath(t) for t in args.trees]
    for t in trees:
        if not all(os.path.isdir(os.path.join(t, sub)) for sub in ("pitgen", "templates")):
            ap.error(f"{t} holds no pitgen/ and templates/")
    failed = 0
    for rnd in range(args.rounds):
        for tree in trees:
            p = subprocess.run([sys.executable, "-c", PREAMBLE + child, tree, str(args.repeats)],
                               capture_output=True, text=True, cwd=tree)
            lines = [ln[7:] for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            if p.returncode or not lines:
                failed += 1
                print(f"round {rnd}, {tree}: failed\n{p.stderr[-3000:]}", flush=True)
                continue
            for case, row in json.loads(lines[-1]).items():
                print(f"round {rnd}  {os.path.basename(tree):12s} {show(case, row)}", flush=True)
    return 1 if failed else 0
