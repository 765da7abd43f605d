"""`commlens serve`: build the app and run it under uvicorn."""

from __future__ import annotations

from typing import Any

import uvicorn

from .app import create_app
from .settings import Settings


def serve(settings: Settings, ui: Any = None, log_level: str = "info", access_log: bool = True) -> None:
    """Blocks until the server stops. Raises StartupRefusedError / StoreError before listening."""
    app = create_app(settings, ui=ui)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=15,
        proxy_headers=False,
    )
    uvicorn.Server(config).run()
