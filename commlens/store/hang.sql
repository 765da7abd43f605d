-- commlens store schema, hang part: Flight Recorder entries with their state, what the hang analysis
-- (commlens.backend.hang) reads. Written by commlens.store.writer; docs/store.md documents it.

-- One row per Flight Recorder entry of a rank's dump (the rank's last N calls when it was dumped).
CREATE TABLE IF NOT EXISTS fr_entries (
    run_id         INTEGER NOT NULL,
    source_id      INTEGER NOT NULL,
    rank           INTEGER NOT NULL,   -- global rank of the dump
    record_id      BIGINT,             -- the entry's place in the rank's ring buffer
    group_key      VARCHAR,            -- "pg:<name>", as comm_events and process_groups
    group_name     VARCHAR,            -- the process group's name ("0" is the default group)
    group_desc     VARCHAR,            -- its description ("default_pg", a DeviceMesh dim, ...)
    group_ranks    INTEGER[],          -- global ranks from the dump's pg_config; NULL when it lists none
    collective_seq BIGINT,             -- collective_seq_id: the same number on every member for one call
    p2p_seq        BIGINT,             -- p2p_seq_id (point-to-point calls)
    op_id          BIGINT,
    op             VARCHAR NOT NULL,   -- commlens op
    raw_name       VARCHAR,            -- profiling_name ("nccl:all_reduce", "gloo:broadcast")
    is_p2p         BOOLEAN NOT NULL,
    dtype          VARCHAR,
    msg_bytes      BIGINT,
    state          VARCHAR NOT NULL,   -- scheduled | started | completed
    created_us     DOUBLE,             -- time_created_ns / 1000 (wall clock)
    started_us     DOUBLE,             -- time_discovered_started_ns / 1000; NULL when not seen
    completed_us   DOUBLE,             -- time_discovered_completed_ns / 1000; NULL when not seen
    duration_us    DOUBLE,             -- duration_ms x 1000 (NCCL with timing enabled)
    timeout_ms     DOUBLE,
    retired        BOOLEAN NOT NULL
);
