"""Repeating periods of a call sequence (NCCL logs carry no step markers, so their iterations are the
repeating period of each communicator's (op, msg_bytes) sequence).

A period p covers the longest tail of s in which s[i] == s[i + p]; with r = s reversed that tail has
length p + Z_r[p] (Z-function), so every p is scored in O(n). The chosen period maximises the covered
tail (smallest p on ties); it must repeat at least twice and cover at least half of the calls,
otherwise no period is reported. Calls before the tail are setup (offset).

Pure functions: `ingest.aggregates` runs them once per refresh of a run and stores the outcome;
`backend.iterations` documents how they become iterations.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_REPEATS = 2
MIN_COVERAGE = 0.5


def z_function(seq: list[int]) -> list[int]:
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


@dataclass(frozen=True)
class Period:
    period: int
    offset: int  # first call of the repeating part
    repeats: int  # complete repeats from offset


def find_period(seq: list) -> Period | None:
    """The repeating unit of a sequence of hashable items, or None (see the module docstring)."""
    n = len(seq)
    if n < MIN_REPEATS:
        return None
    ids: dict = {}
    rev = [ids.setdefault(x, len(ids)) for x in reversed(seq)]
    z = z_function(rev)
    best_p, best_cov = 0, 0
    for p in range(1, n // MIN_REPEATS + 1):
        cov = min(n, p + z[p])
        if cov // p >= MIN_REPEATS and cov > best_cov:
            best_p, best_cov = p, cov
    if not best_p or best_cov < MIN_COVERAGE * n:
        return None
    return Period(best_p, n - best_cov, best_cov // best_p)
