"""One run's whole analysis in one document: attribution, histograms, predicted against measured,
bandwidth, per-rank totals, where the time goes and findings (`commlens report`, JSON or Markdown).

The time section is read by the adapter (commlens.service.time, from the rows the ingest computed) and
handed in: analyses do not call the service."""

from __future__ import annotations

import json

import duckdb
from pydantic import BaseModel

from commlens.contract.analysis import UNKNOWN_KEY, AttributionSummary, BandwidthReport, Finding, Histogram, RankTotals
from commlens.contract.compare import Comparison
from commlens.contract.hang import HangGroup
from commlens.contract.model_description import ModelDescription
from commlens.contract.predict import PredictInput
from commlens.contract.time import TimeSummary
from commlens.run_json import DelayConfig
from commlens.vocab import evidence_key, format_bytes

from .attribution import attribute_run, attribution_summary
from .bandwidth import WHY, bandwidth
from .compare import PredictionSource, compare, prediction_sources
from .findings import findings
from .hang import root_ranks, run_hang
from .histograms import histogram
from .iterations import run_id_of
from .ranks import process_keys, rank_totals
from .timing.matching import WORLD


class ReportOp(BaseModel):
    op: str
    dtype: str | None
    msg_bytes: int | None
    predicted_calls_per_iter: float
    measured_calls_per_iter: float
    status: str


class ReportScheme(BaseModel):
    scheme: str
    predicted_bytes_per_iter: float | None  # None when the run has no configuration to predict from
    measured_bytes_per_iter: float
    unexplained_bytes_per_iter: float
    ratio: float | None  # measured calls the model explains / predicted
    # config: predicted from the run's configuration; inferred: what the measurements support (the comparison's
    # inferences); none: measured only
    prediction_source: PredictionSource
    ops: list[ReportOp]


class Report(BaseModel):
    run: str
    schemes: list[ReportScheme]
    findings: list[Finding]
    exact: bool
    attribution: AttributionSummary
    comparison: Comparison
    histogram: Histogram
    bandwidth: BandwidthReport
    ranks: RankTotals
    time: TimeSummary | None = None  # None when the caller did not read it
    hang: list[HangGroup] = []  # groups whose latest collective did not complete (Flight Recorder); [] if none
    # the run's rank keys that are processes without a global rank (their files name none: NCCL logs' host:pid,
    # traces without distributedInfo): counted among the ranks of the comparison, histogram and rank totals,
    # not in the run's own count of ranks (global ranks only)
    processes: list[str] = []
    # what a harness run planted (its run.json's `delays`): the ground truth the time section can be read against
    planted_delays: list[DelayConfig] = []


def _planted_delays(con: duckdb.DuckDBPyConnection, run_id: int) -> list[DelayConfig]:
    row = con.execute("SELECT config FROM runs WHERE run_id = ?", [run_id]).fetchone()
    config = (json.loads(row[0]) if isinstance(row[0], str) else row[0]) if row else None
    if not isinstance(config, dict) or not isinstance(config.get("delays"), list):
        return []
    try:
        return [DelayConfig.model_validate(d) for d in config["delays"]]
    except ValueError:  # not a harness run.json's delays
        return []


def build_report(
    con: duckdb.DuckDBPyConnection,
    run: str,
    config: PredictInput | ModelDescription | None = None,
    time: TimeSummary | None = None,
) -> Report:
    attribute_run(con, run)
    comparison = compare(con, run, config)
    has_prediction = comparison.implementation is not None
    sources = prediction_sources(comparison)
    schemes = [
        ReportScheme(
            scheme=s.scheme,
            predicted_bytes_per_iter=s.predicted_bytes_per_iter if has_prediction else None,
            measured_bytes_per_iter=s.measured_bytes_per_iter,
            unexplained_bytes_per_iter=s.unexplained_bytes_per_iter,
            ratio=s.ratio,
            prediction_source=sources[s.scheme],
            ops=[
                ReportOp(
                    op=o.op,
                    dtype=o.dtype,
                    msg_bytes=o.msg_bytes,
                    predicted_calls_per_iter=o.predicted_calls_per_iter,
                    measured_calls_per_iter=o.measured_calls_per_iter,
                    status=o.status,
                )
                for o in s.ops
            ],
        )
        for s in comparison.schemes
    ]
    found = findings(con, run, comparison.findings_input() if has_prediction else None, config)
    run_id = run_id_of(con, run)
    return Report(
        run=run,
        schemes=schemes,
        findings=found,
        exact=comparison.exact,
        attribution=attribution_summary(con, run),
        comparison=comparison,
        histogram=histogram(con, run, weight="bytes"),
        bandwidth=bandwidth(con, run),
        ranks=rank_totals(con, run),
        time=time,
        hang=run_hang(con, run_id),
        processes=sorted(process_keys(con, run_id)),
        planted_delays=_planted_delays(con, run_id),
    )


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:g}" if abs(x) < 1e6 else f"{x:.4g}"


_NORMALIZATION = {
    "per_rank_per_iteration": "per rank per iteration",
    "per_rank": "per rank (iterations unknown)",
    "none": "totals over all ranks",
}


def _histogram_md(h: Histogram) -> list[str]:
    """Per scheme, the non-empty power-of-two bins of every (op, dtype): calls and bytes."""
    lines = ["", f"## Message sizes per scheme ({_NORMALIZATION[h.normalization]})", ""]
    if not h.series:
        return [*lines, "No calls."]
    lines.append(
        f"Power-of-two bins [2^k, 2^(k+1)) bytes; averaged over {h.n_ranks} rank(s)."
        + (f" Left out: {', '.join(f'{n} calls ({why})' for why, n in h.excluded.items())}." if h.excluded else "")
    )
    if h.notes:  # as the dashboard's histogram page shows them (iterations, processes without a rank...)
        lines += ["", *[f"- {n}" for n in h.notes]]
    for scheme in dict.fromkeys(s.scheme for s in h.series):
        series = [s for s in h.series if s.scheme == scheme]
        lines += [
            "",
            f"### {scheme or 'unattributed'}",
            "",
            "| size bin | op | dtype | calls | bytes |",
            "|---|---|---|---|---|",
        ]
        unknown = next((i for i, b in enumerate(h.bins) if b.key == UNKNOWN_KEY), None)
        for i, b in enumerate(h.bins):
            for s in series:
                if s.calls[i]:
                    moved = "unknown" if i == unknown else format_bytes(round(s.bytes[i]))
                    lines.append(f"| {b.label} | {s.op} | {s.dtype or '-'} | {_num(s.calls[i])} | {moved} |")
        sized = any(s.calls[i] for s in series for i in range(len(h.bins)) if i != unknown)
        total = format_bytes(round(sum(s.total_bytes for s in series)))
        unsized = unknown is not None and any(s.calls[unknown] for s in series)
        lines.append(
            f"| **total** | | | {_num(sum(s.total_calls for s in series))} | "
            f"{total if sized else 'unknown'}{' (and calls of unknown size)' if sized and unsized else ''} |"
        )
    return lines


def _gbps(x: float) -> str:
    return f"{x:.2f}" if x >= 1 else f"{x:.3g}"


def _left_out(excluded: dict[str, int]) -> str:
    """The calls left out of bandwidth, per reason, with what the reason means where it needs saying (the API's
    `excluded` and the dashboard's "left out" note count the same calls)."""
    return "; ".join(
        f"{n:,} calls: {reason}" + (f" ({WHY[reason]})" if reason in WHY else "")
        for reason, n in sorted(excluded.items(), key=lambda kv: (-kv[1], kv[0]))
    )


def _bandwidth_md(bw: BandwidthReport) -> list[str]:
    """Per op and size bin the median algbw and busbw, and per op the size where busbw reaches half its best;
    the calls left out (no measured duration, no group size...) are counted with their reason, whether or not
    some calls are timed."""
    lines = ["", "## Bandwidth", ""]
    left = sum(bw.excluded.values())
    if not bw.calls_with_duration:  # the notes say why, with the calls of each reason (backend.bandwidth)
        fallback = "no bandwidth" + (f": {_left_out(bw.excluded)}" if left else ": no measured durations")
        return lines + [f"- {n}" for n in bw.notes or [fallback]]
    total = bw.calls_with_duration + left
    lines.append(
        f"Medians over {bw.calls_with_duration:,} of {total:,} calls; busbw = algbw x "
        "the nccl-tests factor of the op for its group size; GB/s = 1e9 B/s."
        + (f" Left out of bandwidth: {_left_out(bw.excluded)}." if left else " No call is left out.")
    )
    if bw.notes:
        lines += ["", *[f"- {n}" for n in bw.notes]]
    lines += [
        "",
        "| op | size bin | calls | median S | median algbw (GB/s) | median busbw (GB/s) | group sizes |",
        "|---|---|---|---|---|---|---|",
    ]
    for b in bw.bins:
        lines.append(
            f"| {b.op} | {b.bin.label} | {b.calls} | {format_bytes(round(b.median_bytes))} | "
            f"{_gbps(b.median_algbw_gbps)} | {_gbps(b.median_busbw_gbps)} | {', '.join(map(str, b.group_sizes))} |"
        )
    lines += [
        "",
        "| op | best busbw (GB/s) | in bin | busbw reaches half the best at | calls below that size |",
        "|---|---|---|---|---|",
    ]
    for o in bw.ops:
        half = format_bytes(o.half_bw_bytes) if o.half_bw_bytes else "-"
        lines.append(f"| {o.op} | {_gbps(o.best_busbw_gbps)} | {o.best_bin} | {half} | {o.latency_bound_calls} |")
    return lines


def _ms(us: float | None) -> str:
    return "-" if us is None else f"{us / 1000:,.2f}"


def _time_group(group: str) -> str:
    """A group as the time analysis names it; its `world` holds the calls whose files name no group."""
    if group == WORLD:
        return "`world` (calls whose files name no process group, matched as the default group's)"
    return f"`{group}`"


def _time_md(t: TimeSummary) -> list[str]:
    """Per rank: step time, exposed and overlapped communication, arrivals and waits; stragglers with
    their evidence or each group's reason for none; what could not be computed."""
    lines = ["", "## Where the time goes", ""]
    if not t.status.available:
        return [*lines, "No time analysis for this run (no trace with a timeline)."]
    c = t.clocks
    one_rank = len({r.rank for r in t.ranks}) == 1
    lines.append(
        (
            f"{t.instances:,} collective instances of one rank (nothing to match across ranks or wait for)."
            if one_rank
            else f"{t.instances:,} collective instances matched across ranks, {t.mismatches:,} mismatch(es)."
        )
        + (f" Clocks: {c.reason}." if c is not None else "")
        + " Times in ms; exposed = communication with no compute running (wait included); wait = from the rank's"
        " arrival to the last member's at its instances, summed (compute may run meanwhile, so it can exceed"
        " exposed)."
    )
    missing = [p for p in t.status.parts if not p.computed]
    if missing:
        lines += ["", "Not computed (or only partly):", ""] + [f"- {p.part}: {p.reason}" for p in missing]
    lines.append("")
    if not t.ranks:
        unranked = any("known rank" in p.reason for p in missing)
        lines.append(
            "No rank has matched instances or profiled steps"
            + (
                ": the time analysis reads the calls of known global ranks, and no file names its rank "
                "(`commlens ingest --rank N` gives a single-rank file's)."
                if unranked
                else "."
            )
        )
    else:
        lines += [
            "| rank | steps | step time (steps summed) | exposed comm | overlapped comm | instances | arrived last | wait "
            "| imposed on others |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
    for r in t.ranks:
        lines.append(
            f"| {r.rank} | {r.steps} | {_ms(r.step_us)} | {_ms(r.exposed_us)} | {_ms(r.overlapped_us)} | "
            f"{r.instances} | {'-' if one_rank else r.arrived_last} | {_ms(r.wait_us)} | {_ms(r.imposed_us)} |"
        )
    lines += ["", "### Stragglers", ""]
    if t.stragglers:
        lines += [
            f"- **rank {s.rank}** ({s.scheme}, group {_time_group(s.group)}): last in {s.arrived_last_share:.0%} of "
            f"{s.instances} instances, consistent in {s.steps_consistent} of {s.steps} steps, imposing "
            f"{s.imposed_ms_per_step:,.2f} ms per step."
            for s in t.stragglers
        ]
    else:
        lines.append("No straggler.")
    lines += [
        f"- group {_time_group(v.group)} ({v.scheme}): {v.reason}" for v in t.verdicts if v.verdict != "straggler"
    ]
    return lines


def _hang_md(groups: list[HangGroup]) -> list[str]:
    """Groups that hung (Flight Recorder): who arrived, who never did and what they were doing; nothing when
    every collective completed."""
    if not groups:
        return []
    lines = ["", "## Hang (Flight Recorder)", ""]
    roots = root_ranks(groups)
    victims = sorted({r for g in groups for r in g.missing_ranks} - set(roots))
    lines += [
        f"**Where it starts: rank {', '.join(map(str, roots))}**"
        + (
            f" (never arrived, and waits in no call that hung; rank {', '.join(map(str, victims))} only missing "
            "because they wait in a call it never entered)."
            if victims
            else "."
        ),
        "",
    ]
    for g in groups:
        lines.append(
            f"- **{g.group}** (`{g.group_key}`): {g.op} #{g.seq}: arrived {g.arrived_ranks}, "
            f"**never arrived {g.missing_ranks}**"
        )
        lines += [f"  - rank {x.rank}: {x.doing}" for x in g.ranks if x.rank in g.missing_ranks]
        lines += [f"  - mismatch: {m}" for m in g.mismatches]
    return lines


def _ranks_sentence(r: Report) -> str:
    """The run's ranks as the run detail counts them (global ranks with calls), the processes without a global
    rank that the histograms and rank totals count beside them, and the ranks the comparison averages over."""
    keys = {row.rank for row in r.ranks.rows}
    processes = len(keys & set(r.processes))
    ranks = len(keys) - processes
    text = f"Ranks with calls: {ranks}" + (
        f", and {processes} process(es) without a global rank (their files name none)" if processes else ""
    )
    compared = len(r.comparison.ranks)
    if compared != len(keys):
        text += f"; {compared} with complete iterations in the comparison"
    return text + "."


# what the comparison's bytes count, against the histograms' and the rank totals' (every call, receives included)
SENT_ONLY = (
    "Bytes sent: the sum of S over each rank's collectives and sends; receives are not added (a send and its "
    "receive move one message), so point-to-point schemes read half the histograms' and the rank totals' bytes."
)


def render_markdown(r: Report) -> str:
    c = r.comparison
    lines = [f"# commlens report: {r.run}", ""]
    lines.append(
        f"Iterations: {c.iterations_message}. {_ranks_sentence(r)} "
        f"Prediction: {c.implementation or 'none (no configuration)'}"
        + ("; **predicted equals measured for every scheme**" if r.exact else "")
        + (f" (of the ranks the files hold: {c.ranks_absent} of the job's are missing)." if c.ranks_absent else ".")
    )
    if c.param_check is not None and not c.param_check.agrees:
        lines += ["", f"**Not exact:** {c.param_check.notes[0]}."]
    if c.another_job is not None:
        lines += ["", f"**Not exact:** {c.another_job}."]
    lines += [
        "",
        "## Process groups",
        "",
        "| group | size | scheme | source | confidence | reason |",
        "|---|---|---|---|---|---|",
    ]
    for g in r.attribution.groups:
        lines.append(
            f"| `{g.group_key}` | {g.size or '-'} | {g.scheme} | {g.source} | {g.confidence:.2f} | {g.reason} |"
        )
    lines += [
        "",
        "## Bytes per iteration per rank",
        "",
        SENT_ONLY,
        "",
        "| scheme | predicted | measured | of which unexplained | explained / predicted |",
        "|---|---|---|---|---|",
    ]
    # A scheme no configuration predicts is measured only: no predicted count, nothing "unexplained" (as the
    # dashboard shows it), rather than a prediction of 0 that every call exceeds.
    predicted = {s.scheme: s.prediction_source == "config" for s in r.schemes}
    for s in r.schemes:
        pred = format_bytes(round(s.predicted_bytes_per_iter)) if s.predicted_bytes_per_iter is not None else "-"
        unexplained = format_bytes(round(s.unexplained_bytes_per_iter)) if predicted[s.scheme] else "-"
        sizes_known = any(o.msg_bytes is not None for o in s.ops)
        measured = (
            format_bytes(round(s.measured_bytes_per_iter)) if sizes_known else "unknown (no call's size is known)"
        )
        lines.append(
            f"| {s.scheme} | {pred} | {measured} | {unexplained} | {'-' if s.ratio is None else f'{s.ratio:.3f}'} |"
        )
    if r.histogram.excluded:  # the per-iteration views leave out calls outside the iterations alike
        left = ", ".join(f"{n} calls ({why})" for why, n in r.histogram.excluded.items())
        lines += ["", f"Left out of the per-iteration tables: {left}; the findings and the rank totals count them."]
    lines += [
        "",
        "## Calls per iteration per rank by (op, size)",
        "",
        "| scheme | op | dtype | S (bytes) | predicted | measured | status |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in r.schemes:
        for o in s.ops:
            said = predicted[s.scheme]
            lines.append(
                f"| {s.scheme} | {o.op} | {o.dtype or '-'} | {o.msg_bytes if o.msg_bytes is not None else '?'} | "
                f"{_num(o.predicted_calls_per_iter) if said else '-'} | {_num(o.measured_calls_per_iter)} | "
                f"{o.status if said else 'measured only'} |"
            )
    if not all(predicted.values()):
        lines += [
            "",
            "Schemes without a prediction are measured only"
            + (" (no configuration: `commlens config` attaches one)." if not c.implementation else "."),
        ]
    lines += _histogram_md(r.histogram) + _bandwidth_md(r.bandwidth)
    if r.time is not None:
        lines += _time_md(r.time)
        lines += [
            f"- planted by the harness (run.json): rank {d.rank} sleeps {d.ms:g} ms before each step's {d.phase}"
            + ("" if d.phase == "forward" else " phase")
            for d in r.planted_delays
        ]
    lines += _hang_md(r.hang)
    if c.inferences:
        lines += ["", "## Inferences (from the measurements, not facts)", ""]
        lines += [f"- {i.quantity}: {i.value:,.0f} — {i.evidence}" for i in c.inferences]
    lines += ["", "## Findings", ""]
    if not r.findings:
        lines.append("No findings.")
    for f in r.findings:
        # the evidence as the dashboard shows it (units, significant digits), the raw value where it has no text
        evidence = ", ".join(
            f"{evidence_key(k)}={f.evidence_text[k]}"
            if k in f.evidence_text
            else f"{k}={_num(v) if isinstance(v, (int, float)) else v}"
            for k, v in f.evidence.items()
            if v is not None
        )
        lines.append(f"- **[{f.severity}] {f.title}** ({evidence}). {f.suggestion}")
    if c.notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in c.notes]
    return "\n".join(lines) + "\n"
