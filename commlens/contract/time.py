"""Where a run's time goes (docs/time.md): per-rank-per-step breakdown, collective instances matched
across ranks, mismatches, clock offsets, stragglers, rank totals and each step's critical path.

Times are µs unless a name says otherwise (`_ms_per_step`); GB = 1e9 bytes. Every list a run can make
long (instances) is a Page; the others are bounded by ranks x steps.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from .analysis import UNATTRIBUTED as UNATTRIBUTED  # the time models name calls without a scheme as everywhere
from .common import Page

# The breakdown's categories in precedence order: each microsecond of a step goes to the first that applies.
TimeCategory = Literal["compute", "overlapped", "wait", "exposed", "memcpy", "idle"]
TIME_CATEGORIES: tuple[str, ...] = ("compute", "overlapped", "wait", "exposed", "memcpy", "idle")


# ---------------------------------------------------------------------------------- status


class TimePart(BaseModel):
    """One part of the time analysis and whether it could be computed for this run (a part may have
    several rows: one per reason)."""

    part: str  # matching | clocks | waits | breakdown | memcpy | stragglers | critical_path
    computed: bool  # false: not computed, or only partly, for the reason given
    reason: str  # why not, or what it rests on


class TimeStatus(BaseModel):
    """What the analysis could and could not compute, and why; `available` is false when the run has
    no time analysis at all (no trace with a timeline)."""

    available: bool
    parts: list[TimePart]


# ---------------------------------------------------------------------------------- clocks


class RankOffset(BaseModel):
    rank: int
    domain: str | None  # clock domain: the host, or "rank<N>" when hosts are unknown
    offset_us: float  # added to the rank's times to put them on the reference clock; 0 when none applied
    estimate_us: float | None  # the domain's estimate even when not applied; None: too little data
    spread_us: float | None  # median absolute deviation of the end differences
    instances: int | None  # symmetric instances the estimate uses


class ClockOffsets(BaseModel):
    """Clock alignment from the instances themselves (the lowest rank's clock is the reference)."""

    applied: bool  # offsets were applied to the ranks' times
    trusted: bool  # cross-rank differences (skew, wait, critical path) are meaningful
    reason: str
    offsets: list[RankOffset]


# ------------------------------------------------------------------------------- breakdown


class SchemeTime(BaseModel):
    """Communication of one scheme in one rank's step, split by the breakdown's precedence."""

    scheme: str  # dp, tp, ... or UNATTRIBUTED
    overlapped_us: float
    wait_us: float
    exposed_us: float


class MemcpyLane(BaseModel):
    """One direction of a rank's step's memory traffic: bytes of the copies starting in the step and
    the time that direction's copies run (union)."""

    direction: str  # htod | dtoh | dtod | ptop | memset
    bytes: int
    busy_us: float
    gbps: float | None  # bytes / busy_us; None when busy_us is 0


class StepBreakdown(BaseModel):
    """One rank's step: the six categories sum to `step_us`; the memcpy lane counts bytes apart."""

    rank: int
    step: int
    step_us: float
    compute_us: float
    overlapped_us: float
    wait_us: float
    exposed_us: float
    memcpy_us: float
    idle_us: float
    schemes: list[SchemeTime]
    memcpy: list[MemcpyLane]


class BreakdownReport(BaseModel):
    """A page of (rank, step) rows, by rank then step (`next_offset` is null on the last page)."""

    run: str
    filters: dict[str, str | int | None]
    rows: list[StepBreakdown]
    total: int
    limit: int
    offset: int
    next_offset: int | None
    notes: list[str] = []  # why the breakdown is missing or partial


OTHER_COMM = "other comm"  # with a scheme chosen: the other schemes' communication, so a bar still sums to the step


class StepRef(BaseModel):
    """One rank's step and its length."""

    rank: int
    step: int
    step_us: float


class RankBand(BaseModel):
    """Consecutive ranks summarised: the mean of their (rank, step) rows per stacked category, and the band's
    fastest and slowest (rank, step), each the first by rank then step among equals."""

    first: int  # the band's global ranks: first to last (the run's highest rank in its last band)
    last: int
    ranks: int  # ranks of the band with rows
    rank_steps: int
    step_us: float  # mean step
    categories: dict[str, float]  # mean µs per TIME_CATEGORIES entry, and OTHER_COMM with a scheme
    fastest: StepRef
    slowest: StepRef


class BreakdownBands(BaseModel):
    """The breakdown of many ranks at a glance: bands of `band` consecutive global ranks (rank // band, as the
    ranks summary), the steps the rows cover and the run's slowest (rank, step) rows, slowest first. With `scheme`, a
    band's overlapped, wait and exposed time is that scheme's and OTHER_COMM the rest of the communication."""

    run: str
    scheme: str | None
    ranks: int
    rank_steps: int
    steps: list[int]
    band: int  # global ranks per band
    bands: list[RankBand]
    slowest: list[StepRef]
    notes: list[str] = []  # why the breakdown is missing or partial


# ------------------------------------------------------------------------------- instances


class InstanceMember(BaseModel):
    rank: int
    seq: int  # with the rank's source, the stored call (comm_events.seq)
    arrival_us: float | None  # the call's start (device kernel, else CPU op), reference clock
    end_us: float | None
    wait_us: float | None  # last arrival - this member's arrival (0 for the last)


class Instance(BaseModel):
    """One collective call matched on every member of its group."""

    instance_id: int  # the run's instance number (stable across pages and filters)
    group: str  # the process group key, or "world" for calls naming no group
    scheme: str
    key: int  # Seq/opCount (keyed_by "key"), or the position in the group's call order
    keyed_by: Literal["key", "order"]
    op: str
    dtype: str | None
    msg_bytes: int | None  # the lowest member's S
    step: int | None
    skew_us: float | None  # last arrival - first arrival; None when clocks cannot be trusted
    last_rank: int | None
    first_arrival_us: float | None  # reference clock
    last_arrival_us: float | None
    real_us: float | None  # end - arrival on the last-arriving member: the collective once all were there
    algbw_gbps: float | None
    busbw_gbps: float | None
    bandwidth_time: Literal["real_us"] = "real_us"  # the time algbw and busbw divide by
    members: list[InstanceMember]  # empty when the page was asked without members (`members_included` false)
    member_count: int = 0  # the instance's members, whether or not they are sent
    members_included: bool = True


# Member rows of one instances page at most: a page stops early (at least one instance) rather than carry more;
# at 1,024 ranks a page of 100 instances would be 102,400 member rows.
MAX_MEMBER_ROWS = 5000


class InstancesPage(Page[Instance]):
    """A page holds at most `limit` instances and, with members, at most `max_members` member rows: follow
    `next_offset` (not offset + limit) to the next page."""

    run: str
    filters: dict[str, str | int | None]
    max_members: int = MAX_MEMBER_ROWS


class Mismatch(BaseModel):
    """Calls that could not be paired: `side_a` on `rank_a` against `side_b` on `rank_b` (None: absent)."""

    group: str
    position: int  # the key (Seq/opCount) or the position in the group's call order
    reason: str
    rank_a: int
    side_a: str | None
    rank_b: int
    side_b: str | None


class MismatchReport(BaseModel):
    run: str
    mismatches: list[Mismatch]
    not_matched: dict[str, int]  # reason -> calls left out of matching


# ------------------------------------------------------------------------------ stragglers


class RankTime(BaseModel):
    """Per rank over its profiled steps (the report's `time.ranks`)."""

    rank: int
    steps: int  # profiled steps of the rank
    instances: int  # matched instances with arrival times it is a member of
    arrived_last: int
    wait_us: float  # the last member's arrival minus its own, summed
    imposed_us: float  # the others' waits in the instances it arrived last in
    step_us: float | None  # its steps' durations summed; None without steps
    exposed_us: float | None  # exposed communication (wait + exposed) over its steps
    overlapped_us: float | None


class RankArrivals(BaseModel):
    """Per group and rank: how often it arrived last, the wait it imposed and the wait it suffered."""

    group: str
    scheme: str
    rank: int
    instances: int
    arrived_last: int
    imposed_us: float  # the other members' waits in the instances it arrived last in
    wait_us: float
    steps: int
    steps_mostly_last: int  # steps where it arrived last in >= the rule's share of the group's instances


class Straggler(BaseModel):
    rank: int
    scheme: str
    group: str
    arrived_last_share: float  # of the group's instances
    steps_consistent: int  # steps where it arrived last in >= the rule's share of instances
    steps: int
    imposed_ms_per_step: float
    instances: int
    verdict: Literal["straggler"] = "straggler"
    reason: str


class GroupVerdict(BaseModel):
    """One group's verdict: its straggler, or why there is none, with the candidate it weighed."""

    group: str
    scheme: str
    verdict: Literal["straggler", "no straggler"]
    reason: str
    candidate_rank: int | None  # the most frequent last arrival
    arrived_last_share: float | None
    steps_consistent: int | None
    steps: int | None
    imposed_ms_per_step: float | None
    instances: int | None


class StragglerReport(BaseModel):
    run: str
    stragglers: list[Straggler]  # empty when no group has one
    groups: list[GroupVerdict]
    ranks: list[RankArrivals]


# --------------------------------------------------------------------------- critical path


class PathSegment(BaseModel):
    rank: int
    start_us: float  # reference clock
    end_us: float
    kind: Literal["work", "collective"]
    instance_id: int | None  # the Instance of a collective segment


class CriticalPath(BaseModel):
    step: int
    start_us: float
    end_us: float
    segments: list[PathSegment]  # from the step's end back to its start; empty when asked without segments
    segment_count: int = 0  # the path's segments, whether or not they are sent
    segments_included: bool = True
    categories: dict[str, float]  # µs per breakdown category on the path
    exposed_share_by_scheme: dict[str, float]  # (wait + exposed) on the path / step time
    note: str | None = None


class CriticalPathReport(BaseModel):
    run: str
    paths: list[CriticalPath]


# --------------------------------------------------------------------------------- summary


class TimeSummary(BaseModel):
    """The run's time at a glance: what was computed, clocks, per-rank totals and stragglers."""

    run: str
    status: TimeStatus
    clocks: ClockOffsets | None
    instances: int
    mismatches: int
    ranks: list[RankTime]
    stragglers: list[Straggler]  # empty when none is named
    verdicts: list[GroupVerdict]
