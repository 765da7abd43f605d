"""Stable row orders of the analysis's columns, cheaper than np.lexsort where the keys allow it."""

from __future__ import annotations

import numpy as np

from .model import Ints

_RADIX_SPAN = 1 << 16  # numpy's stable sort of 16-bit integers is a radix sort


def stable_order(*keys: Ints) -> Ints:
    """The permutation np.lexsort(keys[::-1]) gives: rows by keys[0], then keys[1], ..., rows equal on
    every key in their order. Keys whose value ranges multiply to at most 2^16 (group x rank, rank x
    source) are packed into one 16-bit code and radix sorted: about 9x faster than lexsort on 2 M rows."""
    n = len(keys[0])
    code = np.zeros(n, dtype=np.int64)
    width = 1
    for k in reversed(keys):
        if not n:
            break
        lo, hi = int(k.min()), int(k.max())
        width_next = width * (hi - lo + 1)
        if width_next > _RADIX_SPAN:
            return np.lexsort(keys[::-1]).astype(np.int64, copy=False)
        code += (k - lo) * width
        width = width_next
    return np.argsort(code.astype(np.uint16), kind="stable").astype(np.int64, copy=False)
