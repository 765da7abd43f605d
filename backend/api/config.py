"""PUT /api/runs/{run}/config: attach configuration files to a run (each detected by its content), as
`commlens config` does; the dashboard's upload control sends the same files through ApiClient.attach_config."""

from __future__ import annotations

from fastapi import APIRouter

from commlens.contract.model_description import AttachedConfig, ConfigUpload
from commlens.service.config import attach_config

from .deps import Ctx, Cursor, Writer
from .errors import problem_responses

router = APIRouter(tags=["runs"])


@router.put(
    "/runs/{run}/config",
    response_model=AttachedConfig,
    responses=problem_responses(401, 404, 422),
    summary="Attach configuration: a model description, run.json, config.json, DeepSpeed config or Megatron "
    "arguments (each file's text, detected by content), with the parallel sizes the files lack",
)
def put_config(run: str, body: ConfigUpload, cur: Cursor, ctx: Ctx, _: Writer) -> AttachedConfig:
    with ctx.ingest_queue.run_lock:  # the run is not renamed or deleted meanwhile
        return attach_config(cur, run, body.files, body.options)
