"""The Dash dashboard. It talks to the API only, through `frontend.client`.

`create_ui()` is mounted at / by `commlens serve`; `commlens ui --api URL` (or
`python -m commlens.frontend --api URL`) serves it alone against a remote API.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import create_ui

__all__ = ["create_ui"]


def __getattr__(name: str) -> Any:
    # Dash is imported with the app only: the CLI's commands that talk to a server import `frontend.client`,
    # which would otherwise pay 0.5 s for Dash and Plotly before sending one request.
    if name == "create_ui":
        from .app import create_ui

        return create_ui
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
