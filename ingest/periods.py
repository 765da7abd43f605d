"""Repeating periods of a call sequence (NCCL logs carry no step markers, so their iterations are the
repeating period of each communicator's (op, msg_bytes) sequence).

A period p covers the longest tail of s in which s[i] == s[i + p]; with r = s reversed that tail has
length p + Z_r[p], where Z_r[p] is the longest common prefix of r and r[p:] (the Z-function). The
chosen period maximises the covered tail (smallest p on ties); it must repeat at least twice and cover
at least half of the calls, otherwise no period is reported. Calls before the tail are setup (offset).

`find_period_tokens` computes this with numpy on integer tokens: Z_r[p] only for the candidate p whose
first min(p, CANDIDATE_PREFIX) items repeat (a period repeating twice needs Z_r[p] >= p), each by a
vectorised first-mismatch search, skipping the multiples of the best period found so far (they cover
exactly the same tail, see `_skippable`). Logs of millions of calls then cost milliseconds per
communicator instead of a Python loop per call. `z_function` is the plain O(n) reference, used when a
sequence has pathologically many candidates.

Pure functions: `commlens.store.aggregates` runs them once per refresh of a run and stores the outcome;
`backend.iterations` documents how they become iterations.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

MIN_REPEATS = 2
MIN_COVERAGE = 0.5
CANDIDATE_PREFIX = 32  # items every candidate period must repeat before its Z value is computed
MAX_EXACT_CHECKS = 4096  # Z values computed one by one before falling back to the full Z-function


@dataclass(frozen=True)
class Period:
    period: int
    offset: int  # first call of the repeating part
    repeats: int  # complete repeats from offset


def z_function(seq: Sequence) -> list[int]:
    """Z[i] = length of the longest common prefix of seq and seq[i:] (Z[0] = len(seq))."""
    n = len(seq)
    z = [0] * n
    if n:
        z[0] = n
    left = right = 0
    for i in range(1, n):
        if i < right:
            z[i] = min(right - i, z[i - left])
        while i + z[i] < n and seq[z[i]] == seq[i + z[i]]:
            z[i] += 1
        if i + z[i] > right:
            left, right = i, i + z[i]
    return z


def find_period(seq: Sequence[Hashable]) -> Period | None:
    """The repeating unit of a sequence of hashable items, or None (see the module docstring)."""
    ids: dict = {}
    return find_period_tokens(np.fromiter((ids.setdefault(x, len(ids)) for x in seq), dtype=np.int64, count=len(seq)))


def find_period_tokens(tokens: np.ndarray) -> Period | None:
    """`find_period` of a 1-D integer array (equal items, equal tokens)."""
    n = len(tokens)
    if n < MIN_REPEATS:
        return None
    rev = np.ascontiguousarray(tokens[::-1])
    best = _best_period(rev)
    if best is None:
        best = _best_period_z(rev)
    best_p, best_cov = best
    if not best_p or best_cov < MIN_COVERAGE * n:
        return None
    return Period(best_p, n - best_cov, best_cov // best_p)


def _best_period_z(rev: np.ndarray) -> tuple[int, int]:
    """(p, covered tail) by the definition, with the full Z-function."""
    n = len(rev)
    z = z_function(rev.tolist())
    best_p, best_cov = 0, 0
    for p in range(1, n // MIN_REPEATS + 1):
        cov = min(n, p + z[p])
        if cov // p >= MIN_REPEATS and cov > best_cov:
            best_p, best_cov = p, cov
    return best_p, best_cov


def _lcp(rev: np.ndarray, p: int) -> int:
    """Z[p] of rev: compared in chunks that double, so the cost follows the answer, not len(rev)."""
    n = len(rev)
    i, chunk = 0, 256
    while i < n - p:
        j = min(n - p, i + chunk)
        mismatch = np.flatnonzero(rev[i:j] != rev[p + i : p + j])
        if mismatch.size:
            return i + int(mismatch[0])
        i, chunk = j, chunk * 2
    return n - p


def _candidates(rev: np.ndarray) -> np.ndarray:
    """Every p <= n/2 that could repeat twice (Z[p] >= p): its first min(p, CANDIDATE_PREFIX) items repeat."""
    n = len(rev)
    max_p = n // MIN_REPEATS
    k = CANDIDATE_PREFIX
    small = np.arange(1, min(k, max_p + 1))
    if max_p < k:
        return small
    ok = np.ones(max_p - k + 1, dtype=bool)  # p = k .. max_p; p + j <= max_p + k - 1 < n
    for j in range(k):
        ok &= rev[k + j : max_p + 1 + j] == rev[j]
    return np.concatenate([small, np.flatnonzero(ok) + k])


def _skippable(p: int, best_p: int, best_cov: int) -> bool:
    """A multiple of the best period p0 below its covered tail c covers exactly c again.

    r[0:c] has period p0 and r[c] != r[c - p0] (c < n). For p = k*p0 < c, r[i] == r[i + p] while
    i + p < c, and at i = c - p, r[c - p] == r[c - p0] != r[c] (same residue mod p0, both below c), so
    Z[p] = c - p and p covers c: never strictly more than the best."""
    return best_p > 0 and p % best_p == 0 and p < best_cov


def _best_period(rev: np.ndarray) -> tuple[int, int] | None:
    """(p, covered tail) like `_best_period_z`, or None when the candidates are too many to check."""
    n = len(rev)
    best_p, best_cov = 0, 0
    checks = 0
    for p in _candidates(rev).tolist():
        if _skippable(p, best_p, best_cov):
            continue
        checks += 1
        if checks > MAX_EXACT_CHECKS:
            return None
        z = _lcp(rev, p)
        if z < p:
            continue
        cov = min(n, p + z)
        if cov > best_cov:
            best_p, best_cov = p, cov
            if best_cov == n:
                break
    return best_p, best_cov
