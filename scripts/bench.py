"""Benchmark: pitgen against its peers on PIT's workloads (micro, seqlen, ffn, moe).
The same as ``pitgen bench peers --out docs/bench [options]``
(pitgen/bench/peers.py)."""
import sys

from pitgen.bench import main

if __name__ == "__main__":  # worker processes (spawn) import this file again
    sys.exit(main(["peers", "--out", "docs/bench", *sys.argv[1:]]))
