"""The UI's one way to the API: a typed httpx client returning the wire contract's pydantic models.

Every number the dashboard shows comes through here. Errors become `ApiProblem` with the API's
problem+json detail (or a sentence about the connection), so pages can say what went wrong in words.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel

from commlens.contract.analysis import (
    BandwidthReport,
    BarCalls,
    Finding,
    GroupsPage,
    Histogram,
    RankSummary,
    RankTotals,
    TopologyRows,
)
from commlens.contract.common import Page
from commlens.contract.compare import Comparison, RunsComparison
from commlens.contract.hang import HangReport, RankSourcesReport
from commlens.contract.jobs import JobOut
from commlens.contract.model_description import AttachedConfig, ConfigUpload
from commlens.contract.pairs import PairsReport
from commlens.contract.predict import PredictInput, Prediction
from commlens.contract.review import Anchor, ReviewCreate, ReviewItem, ReviewUpdate
from commlens.contract.runs import RunCreate, RunDetail, RunSummary, RunUpdate, SourceOut
from commlens.contract.time import (
    BreakdownBands,
    BreakdownReport,
    CriticalPathReport,
    Instance,
    InstancesPage,
    MismatchReport,
    StragglerReport,
    TimeSummary,
)
from commlens.contract.users import Me

M = TypeVar("M", bound=BaseModel)

# Reads of big runs (comparison, findings) can take a while; connecting must not.
TIMEOUT = httpx.Timeout(180.0, connect=5.0)
UPLOAD_TIMEOUT = httpx.Timeout(900.0, connect=5.0)


class ApiProblem(Exception):  # noqa: N818 - the client's public name, caught by the CLI and scripts
    """An API error (status and the API's detail) or an unreachable API (status 0)."""

    def __init__(self, status: int, detail: str, title: str = ""):
        self.status = status
        self.detail = detail
        self.title = title
        super().__init__(f"{status} {title}: {detail}" if status else detail)


def _problem(resp: httpx.Response) -> ApiProblem:
    try:
        body = resp.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and "detail" in body:
        detail = body["detail"]
        if not isinstance(detail, str):
            detail = json.dumps(detail)[:500]
        # Validation problems list each bad field ({"field", "message"}); the detail names the first five.
        fields = [
            f"{e.get('field')}: {e.get('message')}"
            for e in body.get("errors") or []
            if isinstance(e, dict) and e.get("field") and e.get("message")
        ]
        missing = [f for f in fields if f not in detail]
        if missing:
            detail += " (" + "; ".join(missing[:5]) + ")"
        return ApiProblem(resp.status_code, detail, str(body.get("title", "")))
    return ApiProblem(resp.status_code, resp.text[:300] or resp.reason_phrase, resp.reason_phrase)


class ApiClient:
    """Calls the commlens API at `base_url` (the server root; routes are under /api) as `token`'s user."""

    def __init__(self, base_url: str, token: str | None = None, http: httpx.Client | None = None):
        self.base_url = base_url.rstrip("/")
        self._http = http or httpx.Client(timeout=TIMEOUT)
        self._headers = {"Authorization": f"Bearer {token.strip()}"} if token and token.strip() else {}

    # ------------------------------------------------------------------------------ plumbing

    def _request(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        json_body: Any = None,
        files: Any = None,
        timeout: httpx.Timeout = TIMEOUT,
    ) -> httpx.Response:
        clean = {k: v for k, v in (params or {}).items() if v is not None and v != ""}
        try:
            resp = self._http.request(
                method,
                f"{self.base_url}/api{path}",
                params=clean,
                json=json_body,
                files=files,
                headers=self._headers,
                timeout=timeout,
            )
        except httpx.TimeoutException:
            raise ApiProblem(0, f"the API at {self.base_url} did not answer {method} /api{path} in time") from None
        except httpx.HTTPError as exc:
            raise ApiProblem(0, f"cannot reach the API at {self.base_url}: {exc}") from None
        if resp.status_code >= 400:
            raise _problem(resp)
        return resp

    def _get(self, path: str, model: type[M], **params: Any) -> M:
        return model.model_validate_json(self._request("GET", path, params=params).content)

    def _send(self, method: str, path: str, model: type[M], body: BaseModel | dict[str, Any] | None) -> M:
        payload = body.model_dump(mode="json", exclude_unset=True) if isinstance(body, BaseModel) else body
        return model.model_validate_json(self._request(method, path, json_body=payload).content)

    # ---------------------------------------------------------------------------- who / runs

    def me(self) -> Me:
        return self._get("/me", Me)

    def runs(self, q: str | None = None, tag: str | None = None, limit: int = 50, offset: int = 0) -> Page[RunSummary]:
        return self._get("/runs", Page[RunSummary], q=q, tag=tag, limit=limit, offset=offset)

    def run(self, run: str) -> RunDetail:
        return self._get(f"/runs/{_seg(run)}", RunDetail)

    def create_run(self, body: RunCreate) -> RunDetail:
        return self._send("POST", "/runs", RunDetail, body)

    def update_run(self, run: str, body: RunUpdate) -> RunDetail:
        return self._send("PATCH", f"/runs/{_seg(run)}", RunDetail, body)

    def delete_run(self, run: str) -> None:
        self._request("DELETE", f"/runs/{_seg(run)}")

    def sources(self, run: str, limit: int = 200, offset: int = 0) -> Page[SourceOut]:
        return self._get(f"/runs/{_seg(run)}/sources", Page[SourceOut], limit=limit, offset=offset)

    def upload(
        self, run: str, files: Sequence[tuple[str, bytes]], rank: int | None = None, one_run: bool = False
    ) -> JobOut:
        """Upload files; those of several jobs become one run each unless `one_run`."""
        parts = [("files", (name, data, "application/octet-stream")) for name, data in files]
        params = {"rank": rank, "one_run": "true" if one_run else None}
        resp = self._request("POST", f"/runs/{_seg(run)}/files", params=params, files=parts, timeout=UPLOAD_TIMEOUT)
        return JobOut.model_validate_json(resp.content)

    def attach_config(self, run: str, body: ConfigUpload) -> AttachedConfig:
        """The run's configuration from files (model description, run.json, config.json, DeepSpeed, Megatron)."""
        return self._send("PUT", f"/runs/{_seg(run)}/config", AttachedConfig, body)

    def job(self, job_id: str) -> JobOut:
        return self._get(f"/jobs/{_seg(job_id)}", JobOut)

    # ------------------------------------------------------------------------------ analysis

    def groups(self, run: str, limit: int = 1000, offset: int = 0) -> GroupsPage:
        return self._get(f"/runs/{_seg(run)}/groups", GroupsPage, limit=limit, offset=offset)

    def histogram(
        self,
        run: str,
        *,
        scheme: str | None = None,
        op: str | None = None,
        dtype: str | None = None,
        rank: int | None = None,
        step: int | None = None,
        weight: str = "calls",
        normalize: bool = True,
    ) -> Histogram:
        return self._get(
            f"/runs/{_seg(run)}/histograms",
            Histogram,
            scheme=scheme,
            op=op,
            dtype=dtype,
            rank=rank,
            step=step,
            weight=weight,
            normalize=str(normalize).lower(),
        )

    def bandwidth(self, run: str) -> BandwidthReport:
        return self._get(f"/runs/{_seg(run)}/bandwidth", BandwidthReport)

    def ranks(self, run: str, first: int | None = None, last: int | None = None) -> RankTotals:
        """Per-rank rows of every rank, or of the global ranks in [first, last]."""
        return self._get(f"/runs/{_seg(run)}/ranks", RankTotals, first=first, last=last)

    def ranks_summary(
        self, run: str, metric: str = "bytes", basis: str = "per_iteration", band: int = 32
    ) -> RankSummary:
        return self._get(f"/runs/{_seg(run)}/ranks/summary", RankSummary, metric=metric, basis=basis, band=band)

    def pairs(
        self, run: str, group: str | None = None, step: int | None = None, bins: int | None = None
    ) -> PairsReport:
        """Sender x receiver bytes of the run's all_to_all calls per group, over the run or one step (with
        `bins`, groups wider than that as blocks of consecutive ranks, summed by the server)."""
        return self._get(f"/runs/{_seg(run)}/pairs", PairsReport, group=group, step=step, bins=bins)

    def report(self, run: str, fmt: str = "json") -> str:
        """The run's report as `commlens report` prints it: JSON or Markdown text."""
        return self._request("GET", f"/runs/{_seg(run)}/report", params={"format": fmt}).text

    def findings(self, run: str, limit: int = 50, offset: int = 0) -> Page[Finding]:
        return self._get(f"/runs/{_seg(run)}/findings", Page[Finding], limit=limit, offset=offset)

    def promote_finding(self, run: str, finding_id: str) -> ReviewItem:
        return self._send("POST", f"/runs/{_seg(run)}/findings/{_seg(finding_id)}/review", ReviewItem, None)

    def predicted_vs_measured(self, run: str, supplied: PredictInput | None = None) -> Comparison:
        """The run's measured calls against the prediction of its own config, or of `supplied`."""
        if supplied is None:
            return self._get(f"/runs/{_seg(run)}/comparison", Comparison)
        return self._send("POST", f"/runs/{_seg(run)}/comparison", Comparison, supplied.model_dump(mode="json"))

    def compare_runs(self, runs: Sequence[str]) -> RunsComparison:
        """Several runs side by side, each predicted against measured (GET /compare)."""
        return self._get("/compare", RunsComparison, runs=",".join(runs))

    def predict(self, body: PredictInput) -> Prediction:
        return self._send("POST", "/predict", Prediction, body.model_dump(mode="json"))

    def topology(
        self, run: str, table: str, limit: int = 500, offset: int = 0, group_key: str | None = None
    ) -> TopologyRows:
        return self._get(
            f"/runs/{_seg(run)}/topology/{_seg(table)}", TopologyRows, limit=limit, offset=offset, group_key=group_key
        )

    def bar_calls(
        self,
        run: str,
        *,
        bin: str | None = None,
        scheme: str | None = None,
        op: str | None = None,
        dtype: str | None = None,
        rank: int | None = None,
        step: int | None = None,
        normalize: bool = True,
        limit: int = 100,
        offset: int = 0,
    ) -> BarCalls:
        """The calls of one histogram bar, with the histogram's own filters (GET /runs/{run}/calls)."""
        return self._get(
            f"/runs/{_seg(run)}/calls",
            BarCalls,
            bin=bin,
            scheme=scheme,
            op=op,
            dtype=dtype,
            rank=rank,
            step=step,
            normalize=str(normalize).lower(),
            limit=limit,
            offset=offset,
        )

    # ---------------------------------------------------------------------------------- time

    def time_summary(self, run: str) -> TimeSummary:
        """What the time analysis computed (and why not), clock offsets, rank totals, stragglers."""
        return self._get(f"/runs/{_seg(run)}/time", TimeSummary)

    def time_breakdown(
        self,
        run: str,
        *,
        rank: int | None = None,
        step: int | None = None,
        scheme: str | None = None,
        limit: int = 1000,
        offset: int = 0,
        first: int | None = None,
        last: int | None = None,
    ) -> BreakdownReport:
        """One page of (rank, step) rows; `scheme` keeps only that scheme's split in each row; `first` and `last`
        bound the ranks."""
        return self._get(
            f"/runs/{_seg(run)}/time/breakdown",
            BreakdownReport,
            rank=rank,
            step=step,
            scheme=scheme,
            limit=limit,
            offset=offset,
            first=first,
            last=last,
        )

    def time_breakdown_bands(self, run: str, *, scheme: str | None = None, band: int | None = None) -> BreakdownBands:
        """The breakdown per band of `band` consecutive ranks (default: the server's), computed by the server."""
        return self._get(f"/runs/{_seg(run)}/time/breakdown/bands", BreakdownBands, scheme=scheme, band=band)

    def time_instances(
        self,
        run: str,
        *,
        group: str | None = None,
        op: str | None = None,
        step: int | None = None,
        rank: int | None = None,
        limit: int = 100,
        offset: int = 0,
        members: bool = True,
        max_members: int | None = None,
    ) -> InstancesPage:
        """One page of collective instances matched across ranks, with each member's arrival and wait (a page
        stops at the server's member-row cap: follow `next_offset`)."""
        return self._get(
            f"/runs/{_seg(run)}/time/instances",
            InstancesPage,
            group=group,
            op=op,
            step=step,
            rank=rank,
            limit=limit,
            offset=offset,
            members=None if members else "false",
            max_members=max_members,
        )

    def time_instance(self, run: str, instance_id: int) -> Instance:
        """One instance with all its members."""
        return self._get(f"/runs/{_seg(run)}/time/instances/{instance_id}", Instance)

    def time_stragglers(self, run: str) -> StragglerReport:
        return self._get(f"/runs/{_seg(run)}/time/stragglers", StragglerReport)

    def critical_paths(self, run: str, step: int | None = None, segments: bool = True) -> CriticalPathReport:
        """Each step's critical path (or one step's); `segments` false sends their count only."""
        return self._get(
            f"/runs/{_seg(run)}/time/critical-path",
            CriticalPathReport,
            step=step,
            segments=None if segments else "false",
        )

    def time_mismatches(self, run: str) -> MismatchReport:
        return self._get(f"/runs/{_seg(run)}/time/mismatches", MismatchReport)

    # -------------------------------------------------------------------------------- review

    def hang(self, run: str) -> HangReport:
        """Groups whose latest collective did not complete, from the run's Flight Recorder dumps."""
        return self._get(f"/runs/{_seg(run)}/hang", HangReport)

    def rank_sources(self, run: str) -> RankSourcesReport:
        """Per rank, the files that describe it and how many of their calls count."""
        return self._get(f"/runs/{_seg(run)}/rank-sources", RankSourcesReport)

    def review(self, run: str, status: str | None = None, limit: int = 100, offset: int = 0) -> Page[ReviewItem]:
        return self._get(f"/runs/{_seg(run)}/review", Page[ReviewItem], status=status, limit=limit, offset=offset)

    def replies(self, item_id: int, limit: int = 1000, offset: int = 0) -> Page[ReviewItem]:
        return self._get(f"/review/{item_id}/replies", Page[ReviewItem], limit=limit, offset=offset)

    def add_review(self, run: str, body: str, anchor: Anchor | None = None, parent_id: int | None = None) -> ReviewItem:
        create = ReviewCreate(body=body, anchor=anchor, parent_id=parent_id)
        return self._send(
            "POST", f"/runs/{_seg(run)}/review", ReviewItem, create.model_dump(mode="json", exclude_none=True)
        )

    def update_review(self, item_id: int, body: ReviewUpdate) -> ReviewItem:
        return self._send("PATCH", f"/review/{item_id}", ReviewItem, body)


def _seg(value: str) -> str:
    """One URL path segment, every reserved character escaped."""
    return quote(value, safe="")
