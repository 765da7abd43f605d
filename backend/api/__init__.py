"""The commlens HTTP API (FastAPI): `create_app(Settings(...), ui=None)`, served by `commlens serve`.

Contract in brief (OpenAPI at /docs and /api/openapi.json has every model):
- Everything is under /api; a UI (Dash, Flask/WSGI or ASGI app) can be mounted at / via `ui=`.
- Errors are application/problem+json (type, title, status, detail; `errors` per field on 422).
- Lists are paginated with limit/offset; every page says `total` and `next_offset` (null on the last).
- Auth: `Authorization: Bearer <token>` (tokens from `commlens users add NAME [--admin]`, stored as
  sha256). A loopback-bound server treats tokenless loopback clients as the admin "local". Bound to
  another address it refuses to start without users unless --insecure; there tokenless requests may
  read, and write only with --insecure. Deleting runs and managing users needs an admin.
- Uploads (`POST /api/runs/{run}/files`, multipart) stream to `<db>.spool/`, are sniffed (415 for
  unknown formats), limited per file and per request (413), and become a job (`GET /api/jobs/{id}`)
  that one worker thread ingests file by file (each file all rows or none).
- One process owns the DuckDB file; each request works on its own cursor, so reads continue while
  the worker writes. Jobs a stopped or killed server left unfinished are marked failed at start-up.
"""

from .app import StartupRefusedError, create_app
from .settings import Settings

__all__ = ["Settings", "StartupRefusedError", "create_app"]
