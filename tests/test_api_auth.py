"""Who may do what: loopback without a token, network binds with users, --insecure, admin-only deletes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from commlens import store
from commlens.backend.api import Settings, StartupRefusedError, create_app
from commlens.backend.api.testing import ServerThread
from commlens.service.users import add_user


def _users(db: Path) -> dict[str, str]:
    con = store.connect(db)
    tokens = {"root": add_user(con, "root", admin=True), "bob": add_user(con, "bob")}
    con.close()
    return tokens


def test_network_bind_without_an_admin_refuses_to_start(tmp_path: Path) -> None:
    """Users but no admin: nobody could add a user once the server holds the store (`users add` is refused
    then, and POST /api/users needs an admin's token), so it does not start."""
    con = store.connect(tmp_path / "s.duckdb")
    add_user(con, "solo")
    con.close()
    with pytest.raises(StartupRefusedError, match="none of the store's users is an admin"):
        create_app(Settings(db=tmp_path / "s.duckdb", host="0.0.0.0"))


def test_network_bind_without_users_refuses_to_start(tmp_path: Path) -> None:
    with pytest.raises(StartupRefusedError, match="no users"):
        create_app(Settings(db=tmp_path / "s.duckdb", host="0.0.0.0"))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "commlens.cli",
            "serve",
            "--db",
            str(tmp_path / "s.duckdb"),
            "--host",
            "0.0.0.0",
            "--port",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert "no users" in proc.stderr and "--insecure" in proc.stderr


def test_network_bind_with_users_needs_tokens_to_write(tmp_path: Path) -> None:
    db = tmp_path / "s.duckdb"
    tokens = _users(db)
    root, bob = ({"Authorization": f"Bearer {tokens[n]}"} for n in ("root", "bob"))
    with ServerThread(Settings(db=db, host="0.0.0.0")) as srv, httpx.Client(base_url=srv.url) as c:
        assert c.get("/api/me").json() == {
            "name": "anonymous",
            "user_id": None,
            "is_admin": False,
            "can_write": False,
            "via": "anonymous",
        }
        assert c.get("/api/runs").status_code == 200  # reads stay open
        r = c.post("/api/runs", json={"name": "anon"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer" and "token" in r.json()["detail"]
        up = c.post("/api/runs/anon/files", files={"files": ("a.log", b"NCCL INFO x\n")})
        assert up.status_code == 401
        assert c.post("/api/runs", json={"name": "bobs"}, headers=bob).status_code == 201
        assert c.post("/api/runs/bobs/review", json={"body": "hi"}).status_code == 401
        assert c.post("/api/runs/bobs/review", json={"body": "hi"}, headers=bob).json()["author"] == "bob"
        assert c.delete("/api/runs/bobs").status_code == 401
        r = c.delete("/api/runs/bobs", headers=bob)
        assert r.status_code == 403 and "admin" in r.json()["detail"]
        assert c.get("/api/users", headers=bob).status_code == 403
        anon = c.get("/api/users")  # a read, for admins only: the answer does not speak of writes
        assert anon.status_code == 401 and "needs an admin's token" in anon.json()["detail"], anon.text
        assert "writes" not in anon.json()["detail"]
        assert "writes need a token" in c.delete("/api/review/1").json()["detail"]
        assert c.post("/api/users", json={"name": "eve", "admin": True}, headers=bob).status_code == 403
        assert c.delete("/api/runs/bobs", headers=root).status_code == 204
        assert c.get("/api/users", headers=root).json()["total"] == 2


def test_network_bind_insecure_allows_tokenless_writes_but_not_admin(tmp_path: Path) -> None:
    with (
        ServerThread(Settings(db=tmp_path / "s.duckdb", host="0.0.0.0", insecure=True)) as srv,
        httpx.Client(base_url=srv.url) as c,
    ):
        assert c.get("/api/health").json()["auth"] == {"loopback_bind": False, "insecure": True, "users": 0}
        assert c.post("/api/runs", json={"name": "open"}).status_code == 201
        assert c.delete("/api/runs/open").status_code == 403


def test_loopback_tokenless_is_the_local_admin_and_tokens_still_count(tmp_path: Path) -> None:
    db = tmp_path / "s.duckdb"
    tokens = _users(db)
    with ServerThread(Settings(db=db)) as srv, httpx.Client(base_url=srv.url) as c:
        assert c.post("/api/runs", json={"name": "mine"}).json()["name"] == "mine"
        bob = {"Authorization": f"Bearer {tokens['bob']}"}
        assert c.delete("/api/runs/mine", headers=bob).status_code == 403  # a token is who you are, even on loopback
        assert c.delete("/api/runs/mine").status_code == 204


def test_a_deployments_admin_token(tmp_path: Path) -> None:
    """COMMLENS_ADMIN_TOKEN (docker-compose): the admin is created, then updated, never duplicated; a short
    token is refused before the server starts."""
    from commlens.service.users import MIN_ADMIN_TOKEN_CHARS, ensure_admin, hash_token

    db = tmp_path / "store.duckdb"
    con = store.connect(db)
    try:
        assert ensure_admin(con, "admin", "a" * MIN_ADMIN_TOKEN_CHARS) is True
        assert ensure_admin(con, "admin", "b" * MIN_ADMIN_TOKEN_CHARS) is False  # rotated at the next start
        assert con.execute("SELECT name, is_admin, token_hash FROM users").fetchall() == [
            ("admin", True, hash_token("b" * MIN_ADMIN_TOKEN_CHARS))
        ]
        with pytest.raises(ValueError, match=f"at least {MIN_ADMIN_TOKEN_CHARS} characters"):
            ensure_admin(con, "admin", "short")
    finally:
        con.close()
    done = subprocess.run(
        [sys.executable, "-m", "commlens.cli", "serve", "--db", str(db), "--host", "0.0.0.0", "--port", "0"],
        env={"COMMLENS_ADMIN_TOKEN": "short", "PATH": ""},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2 and "COMMLENS_ADMIN_TOKEN" in done.stderr and "at least" in done.stderr
