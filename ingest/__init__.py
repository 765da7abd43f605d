"""Ingest: parsers (Kineto JSON, NCCL debug logs, run.json), archives, and the DuckDB store."""
