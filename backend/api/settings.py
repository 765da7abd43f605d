"""Server settings: where the store lives, how it is bound, and the limits on uploads."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from commlens.contract.access import is_loopback
from commlens.ingest.inputs import Limits

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class Settings:
    db: Path = Path("commlens.duckdb")
    host: str = "127.0.0.1"
    port: int = 8050
    insecure: bool = False  # bound off loopback without users: accept anonymous writes
    spool_dir: Path | None = None  # default: "<db>.spool" next to the database
    max_file_bytes: int = 4 * GiB  # one uploaded file, as sent
    max_request_bytes: int = 8 * GiB  # one upload request
    max_files_per_request: int = 1000
    max_json_body_bytes: int = 4 * MiB  # JSON request bodies (runs, review, predict)
    ingest_workers: int = 4  # upload jobs ingested at once; one user holds at most all but one
    ingest_limits: Limits = field(default_factory=Limits)

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)

    @property
    def spool(self) -> Path:
        return self.spool_dir or self.db.with_name(self.db.name + ".spool")
