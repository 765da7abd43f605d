"""From the communication-related events of one Kineto trace to one row per logical call.

A trace can describe one call several times: the dispatcher op (`c10d::allreduce_`), a
`record_param_comms` scope (with or without metadata), the backend's annotation (`nccl:all_reduce`,
`gloo:all_reduce`), a `gpu_user_annotation` and the NCCL kernel (maybe with a copy of the metadata).
They are grouped into calls like this:

1. CPU containers (`c10d::*`, `_c10d_functional::*`, `record_param_comms`) nest by time on their
   thread; each outermost one is a call. Backend annotations join the innermost container on their
   thread that contains their start (gloo's async P2P annotations outlive the op that started them,
   so containment of the whole interval would mis-nest them). Annotations outside any container
   are calls of their own (old traces, gloo work on its worker threads: see 3).
2. NCCL kernels join the call whose root contains their launch (`correlation` -> the runtime launch
   event -> its thread and time); else the call whose CPU event has the kernel's `External id`
   (newer traces point the kernel at `record_param_comms`); else they are calls of their own.
3. gloo runs work on its own threads, so a `gloo:*` annotation there describes a call made by a
   `c10d::*` op on another thread. It is matched to the earliest unmatched compatible op that
   started before it (same input size when both are known) and gives the call its duration; when
   the trace has `c10d::*` ops, unmatched worker annotations belong to calls issued before the
   profiling window and are skipped.

What each call then is (op, sizes, group, duration) is kineto_calls' business.
"""

from __future__ import annotations

import bisect
import re
from collections import Counter, defaultdict, deque
from typing import Any

import orjson

from commlens.vocab import COLLECTIVE_LIKE, SYMM_MEM_NAMESPACE, WRAPPER_NAMESPACES, normalize_op

from .kineto_calls import annot_elems, call_op, container_sizes, kernel_op
from .kineto_fields import SPELLINGS, meta
from .kineto_model import EPS, Call, CpuEv, Kernel, Label, as_float, comm_kernel
from .kineto_records import CpuColumns, KernelColumns, LaunchColumns, map_large_blocks
from .records import ParseError, ParseResult

# Names worth parsing. The byte pattern is what the fast scanner looks for; the str pattern decides.
PREFIXES = (
    r"nccl|c10d::|_c10d_functional::|c10d_functional::|gloo:|ucc:|mpi:|xccl:|record_param_comms|ProfilerStep#"
    r"|commlens:|symm_mem::|vllm::|mscclKernel_"
    # any other namespace's op that looks like a collective: warned about, not dropped silently
    r"|\w+::\w*?(?:[Aa]ll_?[Rr]educe|[Aa]ll_?[Gg]ather|[Rr]educe_?[Ss]catter|[Aa]ll_?[Tt]o_?[Aa]ll)"
)
LABEL_PREFIX = "commlens:"  # the harness's ranges: commlens:<mesh dim>:<pg name> around each collective
LAUNCH_PREFIXES = r"cu\w*Launch|hip\w*Launch"
_WANTED = re.compile(PREFIXES + "|" + LAUNCH_PREFIXES)
STYLE_SAMPLE = 16  # launches looked at to tell how kernels link to CPU ops
# ProcessGroupNCCL's work of a coalescing group (`_coalescing_manager` outside its fast path:
# batch_isend_irecv, broadcasts), whose kernels are launched at the group's end, after the calls' own ops
COALESCED_ANNOT = "nccl:coalesced"
KERNEL_BEFORE_WINDOW = "NCCL kernel launched before the profiler window (its launch is not in the trace)"
_LAUNCH = re.compile(r"(?:cu|hip)\w*Launch")
_ANNOT = re.compile(r"(nccl|gloo|ucc|mpi|xccl):(\w+)")
_STEP = re.compile(r"ProfilerStep#(\d+)")
# gloo implements some ops with others: which worker annotation can carry a call's work.
# The args the parse reads (kineto_fields' spellings and the keys kineto_calls and kineto_timeline name); the
# rest (registers, grid, occupancy...) is dropped as the event arrives. Those that change with every event
# (ids, sequence numbers) are kept on the event's record, the others shared between events (Collector.compact).
_PER_EVENT_ARGS = ("External id", "correlation", "Seq")
_SHARED_ARGS = frozenset(
    {k for keys in SPELLINGS.values() for k in keys}
    | {"Collective name", "Concrete Inputs", "Input Dims", "Input type", "finished"}
)
CpuKind = tuple[str, str | None, str | None]  # a kept CPU event's kind ("container", "annot"), op, backend
# Namespaces of ops and ranges named after the collective they issue through c10d (counted there): FSDP2's
# record_function ranges `FSDP::all_gather (layers.0)`, `FSDP::all_gather_copy_out (layers.0)` and its copy ops
# `fsdp::all_gather_copy_in`, `fsdp::split_with_sizes_copy` (torch 2.4+). Not warned about as not understood.
_FRAMEWORK_RANGES = frozenset({"FSDP", "fsdp"})
_GLOO_COMPATIBLE = {"reduce_scatter": {"reduce_scatter", "all_reduce"}, "barrier": {"barrier", "all_reduce"}}


class Collector:
    """Receives the wanted events in file order and keeps compact records of them: CPU ops, NCCL kernels
    and launches as columns (kineto_records), read as columns by kineto_columns or as objects (`cpu`,
    `kernels`, `launches`) by the reference grouping below."""

    def __init__(self, budget: int | None = None) -> None:
        map_large_blocks()
        self.budget = budget  # records kept (CPU ops, kernels, launches) past which the trace is refused
        self.kept = 0
        self._shared: dict[bytes, dict[str, Any]] = {}  # args the parse reads -> one dict for all events with them
        self.cpu_cols = CpuColumns()
        self.kernel_cols = KernelColumns()
        self.launch_cols = LaunchColumns()
        self._objects: tuple[list[CpuEv], list[Kernel], dict[Any, tuple[Any, Any, float]]] | None = None
        self.steps: dict[int, tuple[float, float]] = {}
        self.labels: list[Label] = []
        self.skipped: dict[str, int] = defaultdict(int)
        # How kernels point at their CPU op: "external_id" (newer Kineto: kernels and launches carry
        # the launching op's External id) or "correlation" (older: both carry the CUDA correlation
        # id, the op is found by where its launch sits on the CPU timeline).
        self.link_style: str | None = None
        self._sampled = 0
        self.not_understood: Counter[str] = Counter()  # op names that look like collectives, not counted

    @property
    def cpu(self) -> list[CpuEv]:
        return self._as_objects()[0]

    @property
    def kernels(self) -> list[Kernel]:
        return self._as_objects()[1]

    @property
    def launches(self) -> dict[Any, tuple[Any, Any, float]]:
        return self._as_objects()[2]

    def release(self) -> None:
        """Drop the records' columns (their counts and interned keys stay): the columnar path calls it once
        it has read them, so the rows do not share the memory with them."""
        self.cpu_cols.release()
        self.kernel_cols.release()
        self.launch_cols.release()

    def _as_objects(self) -> tuple[list[CpuEv], list[Kernel], dict[Any, tuple[Any, Any, float]]]:
        """The records as objects, made once the trace has been read (the reference path)."""
        if self._objects is None:
            self._objects = (self.cpu_cols.objects(), self.kernel_cols.objects(), self.launch_cols.as_dict())
        return self._objects

    def launch(self, pid: Any, tid: Any, ts: float, corr: Any, ext: Any) -> bool:
        """Keep a runtime launch; False once launches are known to be unnecessary."""
        if self.link_style is None:
            self._sampled += 1
            if ext is None or ext == corr:
                self.link_style = "correlation"
            elif self._sampled >= STYLE_SAMPLE:
                self.link_style = "external_id"
        if self.link_style == "external_id":
            return False
        self._keep()
        self.launch_cols.append(pid, tid, ts, corr)
        return True

    def _keep(self, n: int = 1) -> None:
        """Count `n` more kept records against the budget: a trace that would need more is refused now,
        before its records take the memory."""
        self.kept += n
        if self.budget is not None and self.kept > self.budget:
            raise ParseError(
                f"more than {self.budget:,} communication records (CPU ops, NCCL kernels, launches) to hold "
                "while reading the trace: refused to bound memory (`commlens ingest --max-trace-events N` raises the "
                "limit)"
            )

    def compact(self, args: dict[str, Any]) -> dict[str, Any]:
        """The args the parse reads, as one dict shared by every event that carries the same ones."""
        kept = {k: v for k, v in args.items() if k in _SHARED_ARGS}
        key = orjson.dumps(kept, option=orjson.OPT_SORT_KEYS)
        shared = self._shared.get(key)
        if shared is None:
            shared = self._shared[key] = kept
        return shared

    @staticmethod
    def wanted(ev: dict) -> bool:
        name = ev.get("name")
        return isinstance(name, str) and _WANTED.match(name) is not None

    def add(self, ev: dict) -> None:
        name: str = ev["name"]
        ph = ev.get("ph")
        if ph != "X":
            if ph not in ("s", "f", "t", "M", "i", "I"):
                self.skipped[f"event phase {ph!r} (only complete 'X' events are read)"] += 1
            return
        args = ev.get("args")
        if type(args) is not dict:
            args = {}
        ts = ev.get("ts")
        if type(ts) is not float and type(ts) is not int:
            ts = as_float(ts)
            if ts is None:
                self.skipped["event without a numeric ts"] += 1
                return
        if name[0] in "ch" and _LAUNCH.match(name):  # the most frequent wanted event: keep it cheap
            corr = args.get("correlation")
            if corr is not None:
                self.launch(ev.get("pid"), ev.get("tid"), ts, corr, args.get("External id"))
            return
        cat = ev.get("cat") or ""
        dur = as_float(ev.get("dur")) or 0.0
        if name.startswith(LABEL_PREFIX):
            self._label(ev, name, cat, ts, dur)
        elif name.startswith("ProfilerStep#"):
            self._step(name, cat, ts, dur)
        elif cat == "kernel" or cat.startswith("gpu"):
            self._device(name, cat, ts, dur, args)
        else:
            self._cpu(ev, name, ts, dur, args)

    def _label(self, ev: dict, name: str, cat: str, ts: float, dur: float) -> None:
        parts = name.split(":", 2)
        if len(parts) == 3 and parts[1] and parts[2] and not cat.startswith("gpu"):
            self.labels.append(Label(ev.get("pid"), ev.get("tid"), ts, dur, parts[1], parts[2]))

    def _step(self, name: str, cat: str, ts: float, dur: float) -> None:
        """The longest range of each ProfilerStep#n on the CPU."""
        m = _STEP.match(name)
        if m and not cat.startswith("gpu"):
            n = int(m.group(1))
            if n not in self.steps or dur > self.steps[n][1]:
                self.steps[n] = (ts, dur)

    def _device(self, name: str, cat: str, ts: float, dur: float, args: dict[str, Any]) -> None:
        if cat == "kernel" and comm_kernel(name):
            self._keep()
            ext, corr, seq = (args.get(k) for k in _PER_EVENT_ARGS)
            self.kernel_cols.append(name, ts, dur, ext, corr, self.compact(args), seq)
        elif cat == "gpu_user_annotation":
            self.skipped["gpu_user_annotation (the device view of a call already counted)"] += 1

    def _cpu(self, ev: dict, name: str, ts: float, dur: float, args: dict[str, Any]) -> None:
        """record_param_comms, c10d ops and backend annotations (nccl:all_reduce, gloo:...)."""
        what = self.cpu_kind(name, args)
        if isinstance(what, str):
            self.skipped[what] += 1
        if not isinstance(what, tuple):
            return
        kind, op, backend = what
        self._keep()
        ext, seq = args.get("External id"), args.get("Seq")
        self.cpu_cols.append(
            kind, name, op, ev.get("pid"), ev.get("tid"), ts, dur, ext, self.compact(args), backend, seq
        )

    def cpu_kind(self, name: str, args: dict[str, Any], n: int = 1) -> CpuKind | str | None:
        """What a CPU event named `name` is: (kind, op, backend) when kept; else why it is skipped (a str,
        counted by the caller) or None (not counted; `n` such events counted as not understood where the
        name looks like a collective)."""
        kind, op, backend = "container", None, None
        ns = name.split("::", 1)[0] if "::" in name else ""
        if name == "record_param_comms":
            coll = meta(args, "collective")
            op = normalize_op(coll) if isinstance(coll, str) else None
        elif "c10d" in ns or ns == SYMM_MEM_NAMESPACE or ns in WRAPPER_NAMESPACES:
            op = normalize_op(name)
            if op is None:
                if "c10d" not in ns and COLLECTIVE_LIKE.search(name):
                    self.not_understood[name] += n
                return None  # wait_tensor, _wrap_tensor_autograd and other non-collectives
            backend = SYMM_MEM_NAMESPACE if ns == SYMM_MEM_NAMESPACE else None
        elif ns in _FRAMEWORK_RANGES:
            return None  # a framework's range or copy op around the c10d op it issues: not a collective itself
        elif ns:
            self.not_understood[name] += n  # wanted only because the name looks like a collective
            return None
        else:
            m = _ANNOT.match(name)
            if not m:
                return None
            op = normalize_op(name)
            if op is None:
                if name == COALESCED_ANNOT:
                    return "annot", None, "nccl"  # kept: the kernels of the group launched inside it are its
                return f"annotation {name!r} (not a collective)"
            kind, backend = "annot", m.group(1)
        return kind, op, backend


# ------------------------------------------------------------------------------------ grouping


def _is_coalesced(ev: CpuEv) -> bool:
    return ev.kind == "annot" and ev.name == COALESCED_ANNOT


def _skip_coalesced(call: Call, result: ParseResult) -> None:
    """A coalescing group's `nccl:coalesced` work and the kernels launched at its end: the calls issued
    inside the group are counted one by one (without a device duration), so its kernels are no call."""
    if call.kernels:
        result.skip(f"NCCL kernel of a coalescing group ({COALESCED_ANNOT!r})", len(call.kernels))
    result.skip(f"annotation {COALESCED_ANNOT!r} (not a collective)")


def _is_wait(ev: CpuEv) -> bool:
    coll = meta(ev.args, "collective")
    return ev.name == "record_param_comms" and str(coll if coll is not None else "").lower() == "wait"


def build_calls(col: Collector, result: ParseResult) -> list[Call]:
    """Group CPU events into calls and attach kernels and gloo worker annotations."""
    roots = {key: _thread_calls(evs) for key, evs in _by_thread(col.cpu).items()}
    orphans = _attach_kernels(col, roots)
    calls, gloo_workers, unused = _sort_calls(roots, result)
    calls += _kernel_calls(orphans + unused, col, result)
    if gloo_workers:
        calls += _gloo_calls(calls, gloo_workers, result)
    _attach_labels(calls, col.labels)
    calls.sort(key=lambda c: c.issue_ts)
    for name, n in sorted(col.not_understood.items()):
        result.warn(f"{n} events named {name!r} look like a collective but are not understood: not counted")
    return calls


# A thread's calls sorted by issue time, with those times (for bisecting).
_ThreadCalls = tuple[list[float], list[Call]]


def _by_thread(events: list[CpuEv]) -> dict[tuple[Any, Any], list[CpuEv]]:
    by_thread: dict[tuple[Any, Any], list[CpuEv]] = defaultdict(list)
    for ev in events:
        by_thread[(ev.pid, ev.tid)].append(ev)
    return by_thread


def _thread_calls(evs: list[CpuEv]) -> _ThreadCalls:
    """One thread's calls: nested c10d / record_param_comms ops make one call (the outermost is its root);
    each annotation joins the call whose root contains it, else is a call of its own."""
    calls: list[Call] = []
    stack: list[tuple[CpuEv, Call]] = []
    for ev in sorted((e for e in evs if e.kind == "container"), key=lambda e: (e.ts, -e.dur)):
        while stack and ev.ts > stack[-1][0].ts + stack[-1][0].dur + EPS:
            stack.pop()
        if stack and ev.ts + ev.dur <= stack[-1][0].ts + stack[-1][0].dur + EPS:
            call = stack[-1][1]
            call.members.append(ev)
        else:
            stack.clear()
            call = Call(ev, [ev], issue_ts=ev.ts)
            calls.append(call)
        stack.append((ev, call))
    starts = [c.issue_ts for c in calls]
    alone: list[Call] = []
    for ann in sorted((e for e in evs if e.kind == "annot"), key=lambda e: e.ts):
        around = _containing(starts, calls, ann.ts)
        if around is not None:
            around.members.append(ann)
        else:
            alone.append(Call(ann, [ann], issue_ts=ann.ts))
    calls = sorted(calls + alone, key=lambda c: c.issue_ts)
    return [c.issue_ts for c in calls], calls


def _attach_kernels(col: Collector, roots: dict[tuple[Any, Any], _ThreadCalls]) -> list[Kernel]:
    """Each NCCL kernel joins the call around its launch on a CPU thread, else the call of its External
    id; the kernels that join none are returned."""
    by_ext: dict[Any, Call] = {}
    for _, tcalls in roots.values():
        for tcall in tcalls:
            for ev in tcall.members:
                if ev.ext is not None:
                    by_ext.setdefault(ev.ext, tcall)
    orphans: list[Kernel] = []
    for k in col.kernels:
        call = None
        launch = col.launches.get(k.corr) if k.corr is not None else None
        if launch is not None and (launch[0], launch[1]) in roots:
            call = _containing(*roots[(launch[0], launch[1])], launch[2])
        if call is None and k.ext is not None and k.ext != k.corr:
            call = by_ext.get(k.ext)
        if call is not None:
            call.kernels.append(k)
        else:
            orphans.append(k)
    return orphans


def _sort_calls(
    roots: dict[tuple[Any, Any], _ThreadCalls], result: ParseResult
) -> tuple[list[Call], list[Call], list[Kernel]]:
    """(collective calls, gloo worker annotations, kernels of calls that are none) in thread order; waits
    and non-collective record_param_comms are counted as skipped."""
    calls: list[Call] = []
    gloo_workers: list[Call] = []
    unused: list[Kernel] = []
    for _, tcalls in roots.values():
        for call in tcalls:
            root = call.root
            assert root is not None
            if _is_coalesced(root):
                _skip_coalesced(call, result)
            elif _is_wait(root):
                result.skip("record_param_comms 'wait'")
                unused.extend(call.kernels)
            elif root.kind == "annot" and root.backend == "gloo" and not call.kernels:
                gloo_workers.append(call)
            elif call_op(call) is None:
                unused += _skip_not_collective(call, root, result)
            else:
                calls.append(call)
    return calls, gloo_workers, unused


def _skip_not_collective(call: Call, root: CpuEv, result: ParseResult) -> list[Kernel]:
    """Count a call whose op cannot be told as skipped; its kernels, unless they are counted with it."""
    coll = meta(root.args, "collective")
    unused: list[Kernel] = []
    if isinstance(coll, str) and call.kernels:
        # e.g. 'coalesced': the calls of a coalescing group are counted one by one
        result.skip(f"NCCL kernel of record_param_comms {coll!r}", len(call.kernels))
    else:
        unused = call.kernels
    result.skip(
        f"record_param_comms {coll!r} (not a collective)"
        if isinstance(coll, str)
        else "record_param_comms without collective metadata, outside any collective"
    )
    return unused


def _kernel_calls(kernels: list[Kernel], col: Collector, result: ParseResult) -> list[Call]:
    """Calls of kernels without a CPU call, when the kernel's name tells the collective. A kernel whose
    launch is not in the trace (no runtime launch of its correlation id where the trace keeps launches, or
    no External id where kernels name their op by it) was issued before the profiler window: it is no
    call of the window and is counted as skipped; its device time stays on the timeline."""
    calls = []
    for k in kernels:
        launch = col.launches.get(k.corr) if k.corr is not None else None
        if (launch is None and col.link_style == "correlation" and col.launches) or (
            col.link_style == "external_id" and not k.ext
        ):
            result.skip(KERNEL_BEFORE_WINDOW)
            continue
        if kernel_op(k) is None:
            result.skip("NCCL kernel with no CPU call, whose name does not tell the collective (SendRecv, Generic)")
            continue
        calls.append(Call(None, [], [k], issue_ts=launch[2] if launch else k.ts))
    return calls


def _gloo_calls(calls: list[Call], workers: list[Call], result: ParseResult) -> list[Call]:
    """Gloo worker annotations join their c10d calls; the unmatched ones are calls of their own when the
    trace has no c10d ops at all, else skipped (their c10d op was issued before the profiler window)."""
    has_c10d = any(
        c.root is not None and c.root.kind == "container" and c.root.name != "record_param_comms" for c in calls
    )
    unmatched = _match_gloo(calls, workers)
    if not has_c10d:
        return unmatched
    if unmatched:
        result.skip("gloo work annotation whose c10d op is not in the trace (issued before the window)", len(unmatched))
    return []


def _attach_labels(calls: list[Call], labels: list[Label]) -> None:
    """Each call issued inside a commlens:<dim>:<pg> range (same thread) is on that group."""
    if not labels:
        return
    by_thread: dict[tuple[Any, Any], list[Label]] = defaultdict(list)
    for lab in labels:
        by_thread[(lab.pid, lab.tid)].append(lab)
    index = {}
    for key, labs in by_thread.items():
        labs.sort(key=lambda x: x.ts)
        index[key] = ([x.ts for x in labs], labs)
    for call in calls:
        root = call.root
        if root is None or (root.pid, root.tid) not in index:
            continue
        starts, labs = index[(root.pid, root.tid)]
        i = bisect.bisect_right(starts, root.ts + EPS) - 1
        for j in range(i, max(i - 4, -1), -1):
            if labs[j].ts - EPS <= root.ts <= labs[j].ts + labs[j].dur + EPS:
                call.label = labs[j]
                break


def _containing(starts: list[float], calls: list[Call], ts: float) -> Call | None:
    """The call (sorted by start) whose root interval contains ts."""
    i = bisect.bisect_right(starts, ts + EPS) - 1
    for j in range(i, max(i - 4, -1), -1):  # roots rarely overlap; look a little further back
        root = calls[j].root
        if root is not None and root.ts - EPS <= ts <= root.ts + root.dur + EPS:
            return calls[j]
    return None


def _match_gloo(calls: list[Call], workers: list[Call]) -> list[Call]:
    """Attach gloo worker annotations to the c10d calls that issued them; return the unmatched."""
    queues: dict[str, deque[Call]] = defaultdict(deque)
    for w in sorted(workers, key=lambda c: c.root.ts):  # type: ignore[union-attr]
        queues[w.root.op].append(w)  # type: ignore[union-attr, index]
    unmatched: list[Call] = []
    for call in sorted(calls, key=lambda c: c.issue_ts):
        if call.root is None or call.kernels or any(m.kind == "annot" and m.backend == "gloo" for m in call.members):
            continue
        if any(m.kind == "annot" and m.backend == "nccl" for m in call.members):
            continue
        op = call_op(call)
        if op is None:
            continue
        want_in = container_sizes(call).elems_in
        best: tuple[float, str, int] | None = None
        for wop in _GLOO_COMPATIBLE.get(op, {op}):
            q = queues.get(wop)
            if not q:
                continue
            while q and q[0].root.ts < call.issue_ts - EPS:  # type: ignore[union-attr]
                unmatched.append(q.popleft())
            for i, w in enumerate(q):
                if i >= 8:
                    break
                have = annot_elems(w.root)  # type: ignore[arg-type]
                if want_in is not None and have is not None and have != want_in:
                    continue
                if best is None or w.root.ts < best[0]:  # type: ignore[union-attr]
                    best = (w.root.ts, wop, i)  # type: ignore[union-attr]
                break
        if best is not None:
            q = queues[best[1]]
            w = q[best[2]]
            del q[best[2]]
            call.worker = w.root
            call.members.append(w.root)  # type: ignore[arg-type]
    for q in queues.values():
        unmatched.extend(q)
    return unmatched
