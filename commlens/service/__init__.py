"""The operations every adapter calls (the CLI, the API routes, the harness launcher): ingesting a run,
creating, renaming, deleting and listing runs, a run's predictor input, review items, users and
tokens, ingest jobs. Adapters hold no SQL and no sequence of their own; they translate these functions'
results and `errors` into their own output (tables, problem+json)."""
