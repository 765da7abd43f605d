"""The memcpy lane of one rank: per step and copy direction, the bytes of the copies starting in the step
and the time that direction runs in it (the union over streams), stored in time_memcpy."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .model import KIND_CODE, MEMORY_KINDS, RankArrays
from .segments import sparse_sum

LANE_FIELDS = ("rank", "step", "direction", "bytes", "busy_us", "gbps")
Lane = dict[str, list[object]]


def union_arrays(s: npt.NDArray[np.float64], e: npt.NDArray[np.float64]) -> tuple[npt.NDArray[np.float64], ...]:
    """Disjoint sorted intervals covering the given ones."""
    if not len(s):
        return s, e
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    reach = np.maximum.accumulate(e)
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > reach[:-1]
    idx = np.flatnonzero(new)
    return s[idx], reach[np.append(idx[1:], len(s)) - 1]


def memcpy_lane(r: int, d: RankArrays) -> Lane:
    """Rank r's rows (LANE_FIELDS), by direction name then step; none without device activity or steps."""
    out: Lane = {f: [] for f in LANE_FIELDS}
    if not d.has_device or not len(d.steps):
        return out
    iv = d.intervals
    t0s, t1s = d.steps.start, d.steps.end
    steps, starts, ends = d.steps.step.tolist(), t0s.tolist(), t1s.tolist()
    for k in sorted(MEMORY_KINDS):
        sel = iv.kind == KIND_CODE[k]
        if not sel.any():
            continue
        us, ue = union_arrays(iv.start[sel], iv.end[sel])
        order = np.argsort(iv.start[sel], kind="stable")
        ks, kb = iv.start[sel][order], np.concatenate([[0], np.cumsum(iv.nbytes[sel][order])])
        moved = (kb[np.searchsorted(ks, t1s, side="left")] - kb[np.searchsorted(ks, t0s, side="left")]).tolist()
        # The union's pieces meeting the step are a run [lo, hi); the sum over all of them (zeros
        # elsewhere) is taken in numpy's order, as np.clip(...).sum() over the whole union gave it.
        lo = np.searchsorted(ue, t0s, side="right").tolist()
        hi = np.searchsorted(us, t1s, side="left").tolist()
        for j, (n, t0, t1) in enumerate(zip(steps, starts, ends, strict=True)):
            a, z = lo[j], max(hi[j], lo[j])
            b = int(moved[j])
            if z <= a and b == 0:
                continue  # no piece meets the step: busy is 0
            busy = sparse_sum(len(us), a, (np.minimum(ue[a:z], t1) - np.maximum(us[a:z], t0)).tolist() if z > a else [])
            if busy <= 0 and b == 0:
                continue
            out["rank"].append(r)
            out["step"].append(n)
            out["direction"].append(k.removeprefix("memcpy_"))
            out["bytes"].append(b)
            out["busy_us"].append(busy)
            out["gbps"].append(b / (busy * 1e3) if busy > 0 else None)
    return out
