"""Per instance: arrival skew, each member's wait, the last arrival and the collective's real time.

arrival = the member's call start (device kernel start where the trace has one, else the CPU op), on
the reference clock. skew = last arrival - first arrival; wait(member) = last arrival - its arrival.
real_us = end - arrival on the member that arrived last: the time the collective took once everybody
was there (that member never waited). algbw = S / real_us and busbw = algbw x the nccl-tests factor,
both on real_us, in GB/s (1e9 bytes). None where a time is missing or clocks cannot be trusted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from commlens.vocab import busbw_factor

from .clocks import ClockAlignment
from .matching import Instances


@dataclass
class InstanceStats:
    skew_us: list[float | None] = field(default_factory=list)
    last_rank: list[int | None] = field(default_factory=list)
    last_arrival: list[float | None] = field(default_factory=list)  # reference clock
    real_us: list[float | None] = field(default_factory=list)
    algbw_gbps: list[float | None] = field(default_factory=list)
    busbw_gbps: list[float | None] = field(default_factory=list)
    member_wait_us: list[tuple[float | None, ...]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def instance_stats(inst: Instances, clocks: ClockAlignment) -> InstanceStats:
    out = InstanceStats()
    if not clocks.trusted:
        out.notes.append(f"skew and waits not computed: {clocks.reason}")
    missing = 0
    for k in range(len(inst)):
        ranks = inst.member_rank[k]
        arr = [
            None if a is None else clocks.to_reference(r, a) for r, a in zip(ranks, inst.member_arrival[k], strict=True)
        ]
        if not clocks.trusted or any(a is None for a in arr):
            missing += clocks.trusted
            out.skew_us.append(None)
            out.last_rank.append(None)
            out.last_arrival.append(None)
            out.real_us.append(None)
            out.algbw_gbps.append(None)
            out.busbw_gbps.append(None)
            out.member_wait_us.append(tuple(None for _ in ranks))
            continue
        known = [a for a in arr if a is not None]
        last_i = max(range(len(known)), key=lambda i: (known[i], ranks[i]))
        last = known[last_i]
        out.skew_us.append(last - min(known))
        out.last_rank.append(ranks[last_i])
        out.last_arrival.append(last)
        out.member_wait_us.append(tuple(last - a for a in known))
        end = inst.member_end[k][last_i]
        real = None if end is None else clocks.to_reference(ranks[last_i], end) - last
        out.real_us.append(real)
        size = inst.msg_bytes[k]
        if real is None or real <= 0 or size is None:
            out.algbw_gbps.append(None)
            out.busbw_gbps.append(None)
        else:
            alg = size / (real * 1e3)
            out.algbw_gbps.append(alg)
            out.busbw_gbps.append(alg * busbw_factor(inst.op[k], len(ranks)))
    if missing:
        out.notes.append(f"{missing} instances have a member without a start time: no skew or wait for them")
    return out
