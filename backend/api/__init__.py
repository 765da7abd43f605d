"""The commlens HTTP API (FastAPI): `create_app(Settings(...))`, served by `commlens serve`."""

from .app import StartupRefused, create_app
from .settings import Settings

__all__ = ["Settings", "StartupRefused", "create_app"]
