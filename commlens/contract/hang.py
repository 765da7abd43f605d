"""A hang read from Flight Recorder dumps: per process group that did not complete, its latest collective,
the ranks that arrived and those that never did, and what each was doing instead (docs/formats.md F)."""

from __future__ import annotations

from pydantic import BaseModel


class HangRank(BaseModel):
    """One member of a group that hung: its last call in the group and, in words, what it was doing."""

    rank: int
    last_seq: int | None  # its last collective sequence number in the group; None: no entry in the group
    last_op: str | None
    last_state: str | None  # scheduled | started | completed
    doing: str


class HangGroup(BaseModel):
    """A process group whose latest collective (`seq`, `op`) not every member completed."""

    group: str  # the group's description (default_pg, a mesh dimension), else its name
    group_key: str  # "pg:<name>", as process_groups
    op: str
    seq: int  # collective_seq_id of the call the arrived ranks wait in
    msg_bytes: int | None
    arrived_ranks: list[int]
    missing_ranks: list[int]  # members that never entered it
    mismatches: list[str] = []  # members at `seq` whose op or size differs from the first arrival's
    ranks: list[HangRank] = []


class HangReport(BaseModel):
    run: str
    dumped_ranks: list[int]  # ranks with a Flight Recorder dump in the run
    groups: list[HangGroup]  # empty when every collective completed (or no dump)
    # where the hang starts: missing from a hung call and waiting in none (backend.hang.root_ranks)
    root_ranks: list[int] = []


class RankSource(BaseModel):
    """One file describing a rank: its kind, its calls of that rank, and how many of them count (a rank's
    calls count once: a profiler trace supersedes an NCCL log's, Inspector's or Flight Recorder's)."""

    path: str
    kind: str
    calls: int
    counted: int


class RankSources(BaseModel):
    rank: int
    sources: list[RankSource]


class RankSourcesReport(BaseModel):
    run: str
    ranks: list[RankSources]
