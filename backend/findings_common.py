"""What the byte-based findings (findings.py) and the timing findings (findings_time.py) share: a severity
from thresholds, the run's profiled steps that cost per step is measured against, and evidence for people
(units and 3 significant digits; the raw numbers stay in the evidence)."""

from __future__ import annotations

from dataclasses import dataclass

import duckdb

from commlens.contract.analysis import Severity
from commlens.vocab import format_bytes


def severity_from(
    value: float, high: float, medium: float, low: float, higher_is_worse: bool = True
) -> Severity | None:
    """The level `value` reaches among three thresholds, or None under the lowest."""
    if not higher_is_worse:
        value, high, medium, low = -value, -high, -medium, -low
    if value >= high:
        return "high"
    if value >= medium:
        return "medium"
    if value >= low:
        return "low"
    return None


@dataclass(frozen=True)
class Steps:
    """The run's profiled steps: (rank, step) pairs, ranks and the mean step (µs)."""

    rank_steps: int
    ranks: int
    mean_us: float | None

    def cost(self, total_us: float | None) -> tuple[float | None, float | None]:
        """(ms per step and rank, share of the mean step) of a time summed over every rank and step."""
        if total_us is None or not self.rank_steps:
            return None, None
        per_step = total_us / self.rank_steps
        return per_step / 1e3, per_step / self.mean_us if self.mean_us else None


# The run's profiled steps: (rank, step) pairs, ranks, the mean of each pair's longest duration.
STEPS_SQL = """
    SELECT count(*), count(DISTINCT rank), avg(d) FROM (
        SELECT rank, step, max(dur_us) AS d FROM steps WHERE run_id = $run AND rank IS NOT NULL GROUP BY rank, step
    )"""


def profiled_steps(con: duckdb.DuckDBPyConnection, run_id: int) -> Steps:
    """The run's steps as stored with its timing inputs, else (a run not analysed since the store's upgrade)
    from its steps."""
    rows = (
        con.execute(
            "SELECT rank_steps, ranks, mean_step_us FROM time_finding_runs WHERE run_id = ?", [run_id]
        ).fetchall()
        or con.execute(STEPS_SQL, {"run": run_id}).fetchall()
    )
    n, ranks, mean = rows[0]
    return Steps(int(n), int(ranks), mean)


def num(x: float, digits: int = 3) -> str:
    """Significant digits, trailing zeros kept ("25.0", "0.250"), without scientific notation (12,345
    rather than 1.23e+04)."""
    if abs(x) >= 10 ** (digits - 1) or x == 0:
        return f"{x:,.0f}"
    return f"{x:#.{digits}g}".rstrip(".")


def dur(us: float) -> str:
    """A duration in µs for people, in µs, ms or s."""
    if abs(us) >= 1e6:
        return f"{num(us / 1e6)} s"
    return f"{num(us / 1e3)} ms" if abs(us) >= 1e3 else f"{num(us)} µs"


def pct(x: float) -> str:
    return f"{num(100 * x, 2)}%"


def shown(key: str, value: float | int | str, evidence: dict[str, float | int | str | None]) -> str:
    """One evidence value for people, by what its key (or, for a max and mean, the metric beside it) says
    it is."""
    if isinstance(value, str):
        return value
    if key in ("max", "mean") and evidence.get("metric") in ("bytes", "time_us"):
        key = f"{key}_{evidence['metric']}"
    if key.endswith("_us"):
        return dur(value)
    if key.endswith("ms_per_step"):
        return f"{num(value)} ms"
    if key.endswith("_gbps"):
        return f"{num(value)} GB/s"
    if "share" in key or key in ("ratio", "excess", "tolerance"):  # share_of_measured_bytes is a share
        return pct(value)
    if "bytes" in key:
        return format_bytes(int(value))
    if key.endswith(("over_mean", "_ratio")):
        return f"{num(value)}x"
    return f"{value:,}" if isinstance(value, int) else num(value)
