"""The wire contract: every request and response model of the API, by topic.

The API serves these models and the dashboard's client parses them; analysis functions return them
as they are. Nothing here imports more than pydantic, the standard library and `commlens.vocab`, so
a client of the API can install and import it without the server.
"""
