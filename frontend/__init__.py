"""The Dash dashboard. It talks to the API only, through `frontend.client`.

`create_ui()` is mounted at / by `commlens serve`; `commlens ui --api URL` (or
`python -m commlens.frontend --api URL`) serves it alone against a remote API.
"""

from .app import create_ui

__all__ = ["create_ui"]
