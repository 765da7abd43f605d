"""Which `commlens serve` holds a store, so other commands read through it instead of failing on the lock.

DuckDB lets one process open a store file for writing and no other process open it at all. `commlens serve`
writes `<store>.server.json` (its pid and URL) beside the store while it runs; read commands find the server
there, write commands say which API call does their work, and `make demo` refuses to rebuild a served store.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
from pathlib import Path


def marker(db: Path) -> Path:
    """The file beside the store that names the server holding it."""
    return db.with_name(db.name + ".server.json")


def announce(db: Path, url: str) -> None:
    """Say that this process serves `db` at `url` (until `withdraw`)."""
    marker(db).write_text(json.dumps({"pid": os.getpid(), "url": url, "db": str(db.resolve())}) + "\n")


def withdraw(db: Path) -> None:
    """Remove this process's marker (a later server's marker is left alone)."""
    path = marker(db)
    with contextlib.suppress(OSError, ValueError):
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()


def server_for(db: Path) -> str | None:
    """The URL of the live `commlens serve` holding `db`, or None (no marker, or its process is gone)."""
    try:
        info = json.loads(marker(db).read_text())
        pid, url = int(info["pid"]), str(info["url"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return url if _alive(pid) else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def port_in_use(host: str, port: int) -> bool:
    """Whether binding (host, port) would fail with "address already in use" for the server, which binds with
    SO_REUSEADDR (uvicorn does): connections a killed server left in TIME_WAIT do not hold the port, a listener does."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        if os.name == "posix":  # elsewhere SO_REUSEADDR would let the bind share a port another server listens on
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def free_port(host: str) -> int:
    """A port nothing listens on now (the system's choice)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def demo_check(db: Path, port: int) -> str | None:
    """Why `make demo` must not start now (a server holds its store, or its port is taken), with what to do."""
    url = server_for(db)
    if url is not None:
        return (
            f"{db} is served by a running `commlens serve` ({url}); the demo rebuilds that store from scratch. "
            f"Stop that server first (Ctrl-C in its terminal), or run the demo on another store and port: "
            f"make demo DB=demo2.duckdb PORT={port + 1}"
        )
    if db.is_file():
        import duckdb

        try:
            duckdb.connect(str(db), read_only=True).close()
        except duckdb.Error as exc:
            if "lock" in str(exc).lower():
                return f"{db} is held by another process ({str(exc).splitlines()[0]}); stop it first, or: make demo DB=demo2.duckdb"
    if port_in_use("127.0.0.1", port):
        return f"port {port} is in use (another server?); stop it, or pick another port: make demo PORT={port + 1}"
    return None


if __name__ == "__main__":  # the Makefile's demo asks before deleting anything: python -m commlens.cli_server DB PORT
    problem = demo_check(Path(sys.argv[1]), int(sys.argv[2]))
    if problem is not None:
        print(f"make demo: {problem}", file=sys.stderr)
        sys.exit(1)
