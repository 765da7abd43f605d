"""The API's trust rule for tokenless callers, shared by the API server and the standalone UI server.

A loopback-bound API treats loopback clients as its local user; the UI server must apply the same
reading of "loopback" before it puts itself, a loopback client, in front of such an API.
"""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and 'localhost'; False for wildcards (0.0.0.0, ::) and anything else."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
