"""The API's trust rules for tokenless callers, shared by the API server and the standalone UI server.

A loopback-bound API treats loopback clients as its local user; the UI server must apply the same
reading of "loopback" before it puts itself, a loopback client, in front of such an API. Both refuse,
by the same rule (`refusal`), writes a browser makes for another site and requests whose `Host` shows a
DNS-rebound name: the UI turns its visitors' callbacks into the API's tokenless writes, so a rebound page
on the UI's port would otherwise write as the local admin.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from typing import NamedTuple
from urllib.parse import urlsplit

STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
OWN_SITE = frozenset({"same-origin", "none"})  # Sec-Fetch-Site values a page of this server (or the user) sends
_BRACKETED = re.compile(r"^\[([^\]]*)\](?::\d*)?$")  # '[::1]:8050'; '[::1]evil.example' does not match


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and 'localhost'; False for wildcards (0.0.0.0, ::) and anything else."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(host: str) -> str:
    """The name part of a Host header value ('[::1]:8050' -> '::1', 'localhost:80' -> 'localhost'); a value
    that is not a name and a port ('[::1]evil.example') is returned whole, which names no loopback host."""
    if host.startswith("["):
        m = _BRACKETED.fullmatch(host)
        return m.group(1) if m else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class Refusal(NamedTuple):
    status: int
    kind: str
    detail: str


def refusal(
    method: str,
    headers: Mapping[bytes, bytes] | Iterable[tuple[bytes, bytes]],
    scheme: str,
    loopback_bind: bool,
) -> Refusal | None:
    """Why this request must be refused, or None. `headers` are the request's (names in lower case), as a
    mapping or as the ASGI list of pairs: every value of a repeated header is checked, so a foreign value
    is not hidden behind a second, harmless one."""
    values: dict[bytes, list[str]] = {}
    for name, value in headers.items() if isinstance(headers, Mapping) else headers:
        values.setdefault(name, []).append(value.decode("latin-1").strip())
    hosts = values.get(b"host", [])
    host = hosts[0] if len(hosts) == 1 else ""
    if loopback_bind and (len(hosts) > 1 or (host and not is_loopback(host_name(host)))):
        shown = host if len(hosts) == 1 else ", ".join(hosts)
        return Refusal(
            421,
            "misdirected-request",
            f"this server listens on loopback and answers only to a loopback Host (localhost, 127.0.0.1, [::1]), "
            f"not {shown!r}: a name pointed at this machine by another site (DNS rebinding) does not reach it",
        )
    if method not in STATE_CHANGING:
        return None
    for site in (v.lower() for v in values.get(b"sec-fetch-site", [])):
        if site and site not in OWN_SITE:
            return Refusal(
                403,
                "cross-origin-write",
                f"a {site} request may not change anything here (Sec-Fetch-Site: {site}); "
                "write from this server's own pages, the CLI or an HTTP client",
            )
    for seen in values.get(b"origin", []):
        parts = urlsplit(seen)
        if seen == "null" or parts.scheme != scheme or not host or parts.netloc.lower() != host.lower():
            return Refusal(
                403,
                "cross-origin-write",
                f"a request from another origin ({seen}) may not change anything on {scheme}://{host}; "
                "write from this server's own pages, the CLI or an HTTP client",
            )
    return None
