-- commlens store schema, jobs part: the API's background ingest jobs (commlens.service.jobs).
-- Upgrades are explicit: commlens/store/migrations.py (schema version and steps).

-- Background ingest jobs of the API.
CREATE TABLE IF NOT EXISTS jobs (
    job_id      VARCHAR PRIMARY KEY,
    run_id      INTEGER NOT NULL,
    state       VARCHAR NOT NULL,  -- queued | running | done | failed
    files_total INTEGER NOT NULL DEFAULT 0,
    files_done  INTEGER NOT NULL DEFAULT 0,
    bytes_total BIGINT NOT NULL DEFAULT 0,
    bytes_done  BIGINT NOT NULL DEFAULT 0,
    results     JSON,
    error       VARCHAR,
    created_at  TIMESTAMP NOT NULL DEFAULT current_timestamp,
    updated_at  TIMESTAMP NOT NULL DEFAULT current_timestamp
);
