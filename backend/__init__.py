"""Analysis over the store and the FastAPI service."""
