"""One run per job: which of a set of parsed files belong to the same training job.

Files are joined on positive evidence only: a shared NCCL communicator id, or per-rank files of known,
distinct ranks whose absolute time spans overlap. Two groups are never joined when the evidence says
they are different jobs: different world sizes, a rank present in files of one kind in both,
communicator ids that never meet, or time spans more than `APART_S` apart. A file whose job cannot be told (no rank, world size,
communicator id or time) is its own job; a configuration file (a harness run.json) joins the first job.
Everything here is computed from the parse results, before anything is written. The CLI's `ingest` and
the API's upload jobs both split through `commlens.service.ingest.ingest_run(split_jobs=True)`.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from commlens.contract.runs import MAX_RUN_NAME
from commlens.ingest.records import ParseResult

# Timestamps at or above this many microseconds are wall-clock (after 2001-09-09); below, only relative.
EPOCH_US = 1e15
# Spans of one job's files may differ (profiler windows per rank); jobs hours apart are different jobs.
APART_S = 3600.0


@dataclass(frozen=True)
class FileEvidence:
    """What one file says about the job it came from."""

    path: str
    kind: str
    world_size: int | None
    ranks: frozenset[int]
    comm_ids: frozenset[str]
    hosts: frozenset[str]
    span_us: tuple[float, float] | None  # wall-clock microseconds
    calls: int
    processes: frozenset[str] = frozenset()  # NCCL logs: the host:pid of each process

    @property
    def attaches(self) -> bool:
        """A configuration file describes a job rather than being one."""
        return self.kind == "run_config"


@dataclass
class Job:
    """Files of one job and what they say together; `run` is the run it is stored as."""

    run: str
    files: list[FileEvidence] = field(default_factory=list)
    joined_by: list[str] = field(default_factory=list)  # the evidence that put files together
    apart: list[str] = field(default_factory=list)  # why it is not the first job

    @property
    def world_sizes(self) -> set[int]:
        return {f.world_size for f in self.files if f.world_size is not None}

    @property
    def ranks(self) -> frozenset[int]:
        return frozenset().union(*(f.ranks for f in self.files))

    @property
    def comm_ids(self) -> frozenset[str]:
        return frozenset().union(*(f.comm_ids for f in self.files))

    @property
    def hosts(self) -> frozenset[str]:
        return frozenset().union(*(f.hosts for f in self.files))

    @property
    def processes(self) -> frozenset[str]:
        return frozenset().union(*(f.processes for f in self.files))

    @property
    def span_us(self) -> tuple[float, float] | None:
        spans = [f.span_us for f in self.files if f.span_us is not None]
        return (min(s[0] for s in spans), max(s[1] for s in spans)) if spans else None


def evidence(path: str, result: ParseResult) -> FileEvidence:
    """A file's job evidence from its parse: ranks from the file, its calls and its world communicators."""
    ranks: set[int] = set() if result.rank is None else {result.rank}
    times: list[float] = []
    for e in result.events:
        if e.get("rank") is not None:
            ranks.add(int(e["rank"]))
        if e.get("ts_us") is not None:
            times.append(float(e["ts_us"]))
    for table in result.event_tables:
        if "rank" in table.column_names:
            ranks.update(int(r) for r in table.column("rank").to_pylist() if r is not None)
        if "ts_us" in table.column_names:
            times.extend(float(t) for t in table.column("ts_us").to_pylist() if t is not None)
    times.extend(float(s["ts_us"]) for s in result.steps if s.get("ts_us") is not None)
    world = result.world_size
    comm_ids: set[str] = set()
    hosts: set[str] = set()
    processes: set[str] = set()
    for c in result.nccl_comms:
        if c.get("comm_id"):
            comm_ids.add(str(c["comm_id"]))
        if c.get("host"):
            hosts.add(str(c["host"]))
            if c.get("pid") is not None:
                processes.add(f"{c['host']}:{c['pid']}")
        if c.get("comm_rank") is not None and world is not None and c.get("nranks") == world:
            ranks.add(int(c["comm_rank"]))
    span = None
    if times:
        base_ns = result.meta.get("baseTimeNanoseconds")
        offset = base_ns / 1000 if isinstance(base_ns, int | float) and min(times) < EPOCH_US else 0.0
        lo, hi = min(times) + offset, max(times) + offset
        span = (lo, hi) if lo >= EPOCH_US else None
    return FileEvidence(
        path,
        result.kind,
        world,
        frozenset(ranks),
        frozenset(comm_ids),
        frozenset(hosts),
        span,
        result.n_events,
        frozenset(processes),
    )


def _joined_by(a: FileEvidence, b: FileEvidence) -> str | None:
    """The positive evidence that two files are of one job, or None."""
    shared = a.comm_ids & b.comm_ids
    if shared:
        return f"communicator {min(shared)} in both"
    if (
        a.span_us
        and b.span_us
        and a.ranks
        and b.ranks
        and a.span_us[0] <= b.span_us[1]
        and b.span_us[0] <= a.span_us[1]
    ):
        return "ranks of one world, running at the same time"
    return None


def _conflict(a: Job, b: Job) -> str | None:
    """The evidence that two groups of files are different jobs, in words, or None."""
    if a.world_sizes and b.world_sizes and a.world_sizes != b.world_sizes:
        return f"world size {_ints(a.world_sizes)} vs {_ints(b.world_sizes)}"
    # a rank twice in files of one kind: two recordings of that rank; of two kinds (a profiler trace and the
    # rank's Flight Recorder dump or NCCL log) they describe the same process from two sides. One NCCL process
    # (host:pid) in a communicator of both is the same recording twice (a copy, or the job's logs also gathered
    # into one file): one job, whose write refuses the copy as a process already in the run.
    same_process = bool(a.processes & b.processes and a.comm_ids & b.comm_ids)
    both = frozenset().union(*(ranks & _ranks_of_kind(b, kind) for kind, ranks in _ranks_by_kind(a).items()))
    if both and not same_process:
        return f"rank {_ints(both)} in both"
    if a.comm_ids and b.comm_ids and not a.comm_ids & b.comm_ids:
        return "their NCCL communicator ids never meet"
    sa, sb = a.span_us, b.span_us
    if sa and sb and (sb[0] - sa[1] > APART_S * 1e6 or sa[0] - sb[1] > APART_S * 1e6):
        return f"recorded {_when(sa[0])} vs {_when(sb[0])}"
    return None


def _ranks_by_kind(job: Job) -> dict[str, frozenset[int]]:
    out: dict[str, frozenset[int]] = {}
    for f in job.files:
        out[f.kind] = out.get(f.kind, frozenset()) | f.ranks
    return out


def _ranks_of_kind(job: Job, kind: str) -> frozenset[int]:
    return frozenset().union(*(f.ranks for f in job.files if f.kind == kind))


def split_jobs(
    run: str,
    files: Sequence[FileEvidence],
    taken: Collection[str] = (),
    stored: Job | None = None,
    held: Collection[str] = (),
) -> list[Job]:
    """The files grouped into jobs, in the order of their first file; the first job keeps `run` (the first
    with calls, where the first has none: a trace without communication says nothing of its job), the others
    are named `run-<first file's stem>` (with a number where that is in `taken`: names they must not take).
    Configuration files join the first job. `stored`: what `run` holds already (`stored_job`); a first job
    its evidence says is another job does not go into it, and takes a name of its own like the others.
    `held`: paths among `files` that `run` holds already; the jobs they are in are the run's (one job, first,
    whatever else `stored` says: a run stored with --one-run holds several), the others go elsewhere."""
    jobs = [Job("", [f]) for f in files if not f.attaches]
    merged = True
    while merged:
        merged = False
        for i, a in enumerate(jobs):
            for b in jobs[i + 1 :]:
                link = next((r for fa in a.files for fb in b.files if (r := _joined_by(fa, fb))), None)
                if link is not None and _conflict(a, b) is None:
                    a.files.extend(b.files)
                    a.joined_by = sorted({*a.joined_by, *b.joined_by, link})
                    jobs.remove(b)
                    merged = True
                    break
            if merged:
                break
    order = {f.path: i for i, f in enumerate(files)}
    jobs.sort(key=lambda j: min(order[f.path] for f in j.files))
    mine = [j for j in jobs if any(f.path in held for f in j.files)]
    if mine:  # what the run holds is its job, whatever its stored evidence says
        stored = None
        for other in mine[1:]:
            mine[0].files.extend(other.files)
            mine[0].joined_by = sorted({*mine[0].joined_by, *other.joined_by, f"stored in run {run} together"})
            jobs.remove(other)
        jobs.remove(mine[0])
        jobs.insert(0, mine[0])
    elif jobs and not any(f.calls for f in jobs[0].files):
        # a file with no calls says nothing of its job: the run keeps the first job that has calls
        with_calls = next((j for j in jobs if any(f.calls for f in j.files)), None)
        if with_calls is not None:
            jobs.remove(with_calls)
            jobs.insert(0, with_calls)
    if not jobs:
        jobs = [Job(run)]
    jobs[0].files.extend(f for f in files if f.attaches)
    taken = {run, *taken}
    held_apart = None if stored is None or not jobs[0].files else _conflict(stored, jobs[0])
    for i, job in enumerate(jobs):
        job.files.sort(key=lambda f: order[f.path])
        if i == 0 and held_apart is not None:
            job.run = _unique(f"{run}-{_stem(job.files[0].path)}", taken)
            job.apart = [f"{held_apart} (run {run} holds files of another job)"]
            continue
        if i == 0:
            job.run = run
            continue
        job.run = _unique(f"{run}-{_stem(job.files[0].path)}", taken)
        job.apart = [_conflict(jobs[0], job) or "nothing shows they are one job (no shared communicator, rank or time)"]
    return jobs


def stored_job(run: str, world_sizes: Collection[int], comm_ids: Collection[str]) -> Job | None:
    """A stored run's evidence for a later split into it: the world sizes and NCCL communicator ids its files
    gave. Not its ranks or times: a later trace of a rank the run holds (another step window) is welcome, and
    the per-file checks refuse one that overlaps."""
    if not world_sizes and not comm_ids:
        return None
    sizes: list[int | None] = [*sorted(world_sizes)] or [None]
    ids = frozenset(comm_ids)
    return Job(
        run,
        [FileEvidence(f"{run} (stored)", "stored", w, frozenset(), ids, frozenset(), None, 0) for w in sizes],
    )


def describe(job: Job) -> str:
    """A job's identity in a few words: world size, ranks, hosts, communicators, time."""
    parts = []
    if job.world_sizes:
        parts.append(f"world size {_ints(job.world_sizes)}")
    if job.ranks:
        parts.append(f"ranks {_ints(job.ranks)}")
    if job.hosts:
        hosts = sorted(job.hosts)
        parts.append(f"hosts {', '.join(hosts[:3])}{f' +{len(hosts) - 3}' if len(hosts) > 3 else ''}")
    if job.comm_ids:
        parts.append(f"{len(job.comm_ids)} communicator id(s)")
    if (span := job.span_us) is not None:
        parts.append(f"from {_when(span[0])}")
    return "; ".join(parts) or "nothing tells its job"


def job_row(job: Job) -> dict[str, Any]:
    """What went where, one row per run: as an upload job stores it (the API's `JobOut.jobs`)."""
    return {
        "run": job.run,
        "files": [f.path for f in job.files],
        "calls": sum(f.calls for f in job.files),
        "job": describe(job),
        "joined_by": list(job.joined_by),
        "apart": list(job.apart),
    }


def _ints(values: set[int] | frozenset[int]) -> str:
    """Sorted integers with runs of consecutive values as ranges: 0-7, 9."""
    out: list[str] = []
    for v in sorted(values):
        if out and out[-1].split("-")[-1] == str(v - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{v}"
        else:
            out.append(str(v))
    return ", ".join(out)


def _when(us: float) -> str:
    return datetime.fromtimestamp(us / 1e6, tz=UTC).strftime("%Y-%m-%d %H:%M UTC")


def _stem(path: str) -> str:
    name = re.split(r"[/!\\]", path)[-1]
    name = re.sub(r"(\.(json|log|txt|gz|tar|zip|pt|trace))+$", "", name, flags=re.IGNORECASE)
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._-") or "job"


def _unique(name: str, taken: set[str]) -> str:
    """`name`, or `name-2`, `name-3`... where it is taken, cut to a run name's length (MAX_RUN_NAME: the API
    refuses longer ones in every other place) before its number."""
    base = name[:MAX_RUN_NAME].rstrip("._-") or "job"
    out, n = base, 2
    while out in taken:
        suffix = f"-{n}"
        out, n = base[: MAX_RUN_NAME - len(suffix)].rstrip("._-") + suffix, n + 1
    taken.add(out)
    return out
