"""Test data and checks for users of pitgen and for its own tests: mask patterns of every
granularity, and (with Hypothesis installed) strategies that draw them."""
from __future__ import annotations

import numpy as np


# -- mask patterns ------------------------------------------------------------------------------


def tile_mask(rng: np.random.Generator, sq: int, sk: int, tile: tuple[int, int],
              density: float) -> np.ndarray:
    """Random tiles of ``tile`` (e.g. 128x128 blocks, 1x64 or 16x16 micro-tiles), each set with
    probability ``density``, aligned to the tile grid and cut at the edges."""
    tr, tc = max(1, tile[0]), max(1, tile[1])
    grid = rng.random((-(-sq // tr), -(-sk // tc))) < density
    return np.kron(grid, np.ones((tr, tc), bool))[:sq, :sk]


def longformer_mask(sq: int, sk: int, window: int, global_tokens: np.ndarray) -> np.ndarray:
    """Longformer: a band |i - j| <= window // 2, plus global tokens (different every batch) that
    attend to every key and that every query attends to."""
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    m = np.abs(i - j) <= window // 2
    g = np.asarray(global_tokens, np.int64)
    m[g[g < sq], :] = True
    m[:, g[g < sk]] = True
    return m


def random_global_tokens(rng: np.random.Generator, seq: int, count: int) -> np.ndarray:
    """``count`` distinct token positions (Longformer's dynamic global tokens)."""
    return np.sort(rng.choice(seq, size=min(count, seq), replace=False))
