"""Results of the analyses (attribution, iterations, histograms, bandwidth, ranks, findings, a bar's
calls), served by the API as the analysis functions return them, and the bin keys both sides use."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from commlens.vocab import Scheme, format_bytes

from .common import Page, StrictModel

SchemeSource = Literal["override", "label", "structure", "unknown"]
Severity = Literal["high", "medium", "low", "info"]
SEVERITY_ORDER: dict[str, int] = {"high": 0, "medium": 1, "low": 2, "info": 3}

# Query values that select what has no scheme (calls without a group) or no dtype, where null means "any".
UNATTRIBUTED = "unattributed"
NO_DTYPE = "unknown"

ZERO_KEY, UNKNOWN_KEY = "zero", "unknown"
MAX_K = 62  # msg_bytes is a BIGINT: the largest size is in bin 2^62
_POW2_KEY = re.compile(r"2\^(\d{1,2})")


# ------------------------------------------------------------------------------ attribution


class GroupAttribution(BaseModel):
    group_key: str
    name: str | None = None
    description: str | None = None
    ranks: list[int] | None = None
    size: int | None = None
    scheme: Scheme
    source: SchemeSource
    reason: str
    confidence: float = Field(ge=0.0, le=1.0)
    calls: int = 0  # comm events recorded on the group in this run


class AttributionSummary(BaseModel):
    run: str
    groups: list[GroupAttribution]
    unattributed_events: int  # events with no group_key: no scheme can be given to them
    events_by_scheme: dict[str, int]


# ------------------------------------------------------------------------------- iterations


class CommPeriod(BaseModel):
    """The repeating unit of one communicator's (op, msg_bytes) sequence in one process."""

    process: str
    group_key: str | None
    calls: int
    period: int | None  # calls per repeating unit; None when no repetition was found
    offset: int | None = None  # calls before the repeating part starts (setup traffic)
    repeats: int | None = None  # complete repeating units
    units_per_iteration: int | None = None  # repeats / the process's iteration count
    note: str | None = None


class ProcessIterations(BaseModel):
    process: str
    rank: int | None
    iterations: int | None  # None when no communicator of the process repeats


class PeriodReport(BaseModel):
    run: str
    processes: list[ProcessIterations]
    comms: list[CommPeriod]
    found: bool
    message: str


class IterationInfo(BaseModel):
    """How a run's calls divide into iterations, per rank (or per process for rank-less logs)."""

    run: str
    mode: Literal["steps", "detected", "mixed", "none"]
    iterations: dict[str, int]  # rank key -> iterations
    message: str


# ------------------------------------------------------------------------------- histograms


class BinSpec(BaseModel):
    key: str  # "zero", "unknown" or "2^k"
    label: str  # "0 B", "1 KiB-2 KiB", "unknown size"
    k: int | None = None  # bin k = [2^k, 2^(k+1)) bytes
    lo: int | None = None
    hi: int | None = None  # exclusive


def bin_spec(key: str) -> BinSpec:
    """The bin of a key ('zero', 'unknown' or '2^k', 0 <= k <= 62); ValueError for anything else."""
    if key == ZERO_KEY:
        return BinSpec(key=key, label="0 B", k=None, lo=0, hi=1)
    if key == UNKNOWN_KEY:
        return BinSpec(key=key, label="unknown size")
    m = _POW2_KEY.fullmatch(key)
    if m is None or int(m.group(1)) > MAX_K:
        raise ValueError(f"bin must be 'zero', 'unknown' or '2^k' with 0 <= k <= {MAX_K}, not {key!r}")
    k = int(m.group(1))
    lo, hi = 1 << k, 1 << (k + 1)
    return BinSpec(key=key, label=f"{format_bytes(lo)}-{format_bytes(hi)}", k=k, lo=lo, hi=hi)


class HistogramSeries(BaseModel):
    scheme: str | None  # None: calls without a group (not attributable)
    op: str
    dtype: str | None
    calls: list[float]  # aligned with Histogram.bins
    bytes: list[float]
    values: list[float]  # calls or bytes, as Histogram.weight says
    total_calls: float
    total_bytes: float


class Histogram(BaseModel):
    run: str
    weight: Literal["calls", "bytes"]
    normalization: Literal["per_rank_per_iteration", "per_rank", "none"]
    filters: dict[str, str | int | None]
    n_ranks: int
    n_processes: int = 0  # of n_ranks: processes without a global rank (RunDetail.n_processes)
    iterations: IterationInfo | None = None
    bins: list[BinSpec]
    series: list[HistogramSeries]
    excluded: dict[str, int] = {}  # reason -> calls left out of a normalised histogram
    unattributed_events: int = 0
    notes: list[str] = []


# -------------------------------------------------------------------------------- bandwidth


class BinBandwidth(BaseModel):
    op: str
    bin: BinSpec
    calls: int
    median_bytes: float
    median_dur_us: float
    median_algbw_gbps: float
    median_busbw_gbps: float
    group_sizes: list[int]


class OpBandwidth(BaseModel):
    op: str
    calls: int
    best_busbw_gbps: float  # highest bin median
    best_bin: str
    half_bw_bytes: int | None  # smallest bin lower bound whose median busbw reaches half the best
    half_bw_label: str | None
    latency_bound_calls: int  # calls below half_bw_bytes
    latency_bound_time_us: float


class SchemeOpBandwidth(BaseModel):
    scheme: str | None
    op: str
    calls: int
    time_us: float
    median_busbw_gbps: float
    large_calls: int  # calls at or above the op's half-bandwidth size
    large_median_busbw_gbps: float | None


class CallBandwidth(BaseModel):
    rank: int | None
    process: str | None
    scheme: str | None
    op: str
    group_size: int
    msg_bytes: int
    dur_us: float
    algbw_gbps: float
    busbw_gbps: float
    busbw_factor: float


class BandwidthReport(BaseModel):
    run: str
    calls_with_duration: int
    excluded: dict[str, int]  # reason -> calls without a usable measured duration
    bins: list[BinBandwidth]
    ops: list[OpBandwidth]
    by_scheme: list[SchemeOpBandwidth]
    best_busbw_gbps: float | None  # the run's best bin median over all ops
    notes: list[str] = []


# ------------------------------------------------------------------------------------ ranks


class RankSchemeTotal(BaseModel):
    rank: str  # global rank, or the process ("host:pid") when the source has no rank
    scheme: str | None
    calls: int
    bytes: int
    time_us: float | None  # measured durations only
    iterations: int | None
    bytes_per_iteration: float | None
    time_us_per_iteration: float | None


class Imbalance(BaseModel):
    all_schemes: bool = False  # True: every call of the rank, whatever its scheme
    scheme: str | None  # the scheme (None: calls without a scheme) when not all_schemes
    metric: Literal["bytes", "time_us"]
    basis: Literal["per_iteration", "total"]
    ranks: int
    max: float
    mean: float
    max_over_mean: float
    max_rank: str
    min_rank: str


class RankTotals(BaseModel):
    run: str
    rows: list[RankSchemeTotal]  # every rank's, or those in [first, last] when the request names a range
    imbalance: list[Imbalance]  # over every rank of the run, whatever the range
    notes: list[str] = []
    ranks: int = 0  # ranks (or processes) in the run
    n_processes: int = 0  # of `ranks`: processes without a global rank (RunDetail.n_processes)
    first: int | None = None
    last: int | None = None


RankMetric = Literal["bytes", "time_us"]
RankBasis = Literal["per_iteration", "total"]


class RankValue(BaseModel):
    rank: str
    value: float


class SchemeSpread(BaseModel):
    """How one scheme's per-rank values spread: quartiles (inclusive method), extremes and the ranks
    outside Tukey's fences (1.5 IQR beyond the quartiles), farthest first."""

    scheme: str | None
    ranks: int
    min: float
    q1: float
    median: float
    q3: float
    max: float
    mean: float
    min_rank: str
    max_rank: str
    outliers: list[RankValue]  # at most RankSummary.outlier_limit
    outliers_total: int


class RankGroupCell(BaseModel):
    scheme: str | None
    ranks: int
    mean: float
    min: float
    max: float
    min_rank: str
    max_rank: str


class RankGroup(BaseModel):
    """A band of consecutive global ranks, or the processes of one host when ranks are unknown."""

    label: str
    kind: Literal["band", "host"]
    first: int | None  # the band's bounds (inclusive); None for a host
    last: int | None
    members: int
    cells: list[RankGroupCell]


class RankSummary(BaseModel):
    """Per-rank values summarised for runs with many ranks: a spread per scheme and one row per group."""

    run: str
    metric: RankMetric
    basis: RankBasis
    band: int
    ranks: int
    outlier_limit: int
    schemes: list[SchemeSpread]
    groups: list[RankGroup]
    notes: list[str] = []


# --------------------------------------------------------------------------------- findings


class SchemeComparison(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    scheme: str
    predicted_bytes: float
    measured_bytes: float  # what the prediction explains (the unexplained bytes are measured as well)
    unexplained_calls: int = 0
    unexplained_bytes: float = 0.0


class ComparisonInput(BaseModel):
    """What findings need from a predicted-vs-measured comparison (the predictor builds the full one)."""

    model_config = ConfigDict(from_attributes=True)

    per_scheme: list[SchemeComparison]
    basis: str = "per rank per iteration"
    tolerance: float = 0.05


class Finding(BaseModel):
    id: str
    title: str
    severity: Severity
    impact: float  # share of the run's communication (time, else bytes) it concerns, 0..1
    evidence: dict[str, float | int | str | None]
    view: dict[str, str | int | None]
    suggestion: str
    # The cost where durations exist: ms per step and rank, and that as a share of the mean step.
    ms_per_step: float | None = None
    step_share: float | None = None
    stability: str | None = None  # a timing finding: how stable it is across steps and ranks
    evidence_text: dict[str, str] = {}  # the evidence for people (units, significant digits)
    # What a review item can link to: the time analysis's instance ids, profiler steps and ranks.
    instances: list[int] = []
    steps: list[int] = []
    ranks: list[int] = []


class BarCall(BaseModel):
    """One call counted by a histogram bar: its row of the `comms` view and its iteration."""

    run: str
    rank: int | None
    op: str
    dtype: str | None
    msg_bytes: int | None
    elems_in: int | None
    elems_out: int | None
    group_size: int | None
    group_key: str | None
    scheme: str | None
    peer: int | None
    step: int | None  # profiler step (comms.step)
    iteration: int | None  # profiler step, or detected iteration (0-based); null outside complete iterations
    ts_us: float | None
    dur_us: float | None
    source_kind: str
    file: str


class BarCalls(BaseModel):
    """A page of the calls of one histogram bar (limit/offset; `next_offset` is null on the last page)."""

    bin: BinSpec | None  # null: every size
    iterations_only: bool  # only calls inside complete iterations (the bar is normalised per iteration)
    items: list[BarCall]
    total: int
    limit: int
    offset: int
    next_offset: int | None


# ---------------------------------------------------------------------------------- groups


class GroupsPage(Page[GroupAttribution]):
    """A page of the run's process groups with their scheme, and the run's calls per scheme."""

    run: str
    unattributed_events: int  # calls with no group: no scheme can be given to them
    events_by_scheme: dict[str, int]


class GroupOverride(StrictModel):
    scheme: Scheme | None = Field(description="the scheme to pin; null drops the override and attributes again")
    reason: str | None = Field(
        default=None,
        max_length=2000,
        description="what you know that the traces do not say: required with a scheme, refused with null",
    )


# -------------------------------------------------------------------------------- topology


class TopologyRows(BaseModel):
    table: Literal["comms", "topology", "tuning"]
    columns: list[str]
    rows: list[list[Any]]
    total: int
    limit: int
    offset: int
    next_offset: int | None
