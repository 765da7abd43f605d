"""Per-process state of an NCCL log being read: the processes (host:pid, or one device of a paste
without host:pid) with their sequence counters and communicators, and the per-thread init context that
topology lines belong to."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

UNPREFIXED_PROCESS = "unknown"  # the process of lines that lost host:pid (and maybe [dev] too)


@dataclass
class Proc:
    """One process (or, for pastes without host:pid, one device of an unknown process)."""

    key: tuple[Any, ...]
    host: str | None
    pid: int | None
    dev_hint: int | None  # device of an unknown process (None: lines without any envelope)
    seq: list[int] = field(default_factory=lambda: [0])
    comm_devs: dict[str, int | None] = field(default_factory=dict)  # comm label -> CUDA device
    comms: dict[str, dict[str, Any]] = field(default_factory=dict)  # raw pointer -> current nccl_comms row
    instances: dict[str, int] = field(default_factory=dict)  # raw pointer -> instances seen
    version: str | None = None

    @property
    def base(self) -> str:
        if self.host is not None:
            return f"{self.host}:{self.pid}"
        return UNPREFIXED_PROCESS if self.dev_hint is None else f"{UNPREFIXED_PROCESS}/cuda:{self.dev_hint}"

    def label(self, dev: int | None, multi: bool) -> str:
        if self.host is None or not multi or dev is None:
            return self.base
        return f"{self.base}/cuda:{dev}"


@dataclass
class Thread:
    """Per-thread init context: topology lines belong to the communicator being initialised."""

    comm: str | None = None  # comm label of an open Init START / nRanks line
    pending: list[dict[str, Any]] = field(default_factory=list)  # rows waiting for an Init COMPLETE


class Processes:
    """The processes and threads of one log, found by their envelope fields."""

    def __init__(self) -> None:
        self.procs: dict[tuple[Any, ...], Proc] = {}
        self.threads: dict[tuple[Any, ...], Thread] = {}
        self.comm_owner: dict[str, set[tuple[Any, ...]]] = {}  # raw comm pointer -> process keys using it
        self.hosts_seen = False  # a line with a full host:pid:tid [dev] envelope was read

    def proc(self, host: str | None, pid: str | None, dev: int | None) -> Proc:
        if host is not None and (host, pid) not in self.procs:
            host = self.glued_host(host, pid)
        key = (host, pid) if host is not None else (None, dev)
        p = self.procs.get(key)
        if p is None:
            p = self.procs[key] = Proc(key, host, int(pid) if pid is not None else None, None if host else dev)
            self.hosts_seen = self.hosts_seen or host is not None
        return p

    def glued_host(self, host: str, pid: str | None) -> str:
        """A host name with another writer's text glued in front ("Usinghost1") becomes the known
        host it ends with, when exactly one known process of that pid matches."""
        known = {h for h, p in self.procs if h is not None and p == pid and h != host and host.endswith(h)}
        return known.pop() if len(known) == 1 else host

    def thread(self, host: str | None, pid: str | None, tid: str | None, dev: int | None) -> Thread:
        if host is not None and (host, pid) not in self.procs:
            host = self.glued_host(host, pid)
        key = (host, pid, tid, dev if host is None else None)
        t = self.threads.get(key)
        if t is None:
            t = self.threads[key] = Thread()
        return t

    def multi_device(self) -> set[tuple[Any, ...]]:
        """Keys of processes whose communicators live on more than one CUDA device."""
        return {k for k, p in self.procs.items() if p.host is not None and len(set(p.comm_devs.values())) > 1}

    def contexts(self) -> set[str]:
        """The process labels that have communicators (each device of a multi-device process apart)."""
        out: set[str] = set()
        multi = self.multi_device()
        for k, p in self.procs.items():
            if k in multi:
                out.update(p.label(d, True) for d in p.comm_devs.values())
            elif p.comm_devs or p.comms:
                out.add(p.base)
        return out

    def current_nranks(self, host: str | None, pid: str | None, tid: str | None, dev: int | None) -> int | None:
        """nranks of the communicator this thread is initialising, when known."""
        th = self.thread(host, pid, tid, dev)
        if th.comm is None:
            return None
        p = self.proc(host, pid, dev)
        for row in p.comms.values():
            if row["comm_ptr"] == th.comm:
                nranks: int | None = row["nranks"]
                return nranks
        return None
