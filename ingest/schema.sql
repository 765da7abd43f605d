-- commlens store schema. The one file that defines the DuckDB store; docs/store.md documents it.
-- schema_version: 3
-- Upgrades are explicit: bump the version here and add a step in ingest/store.py:MIGRATIONS.

CREATE TABLE IF NOT EXISTS meta (
    key   VARCHAR PRIMARY KEY,
    value VARCHAR NOT NULL
);

CREATE SEQUENCE IF NOT EXISTS run_id_seq START 1;
CREATE SEQUENCE IF NOT EXISTS source_id_seq START 1;
CREATE SEQUENCE IF NOT EXISTS review_id_seq START 1;
CREATE SEQUENCE IF NOT EXISTS user_id_seq START 1;

-- One training job (or one upload of traces that belong together).
CREATE TABLE IF NOT EXISTS runs (
    run_id      INTEGER PRIMARY KEY DEFAULT nextval('run_id_seq'),
    name        VARCHAR NOT NULL UNIQUE,
    description VARCHAR,
    tags        VARCHAR[] NOT NULL DEFAULT [],
    config      JSON,              -- harness run.json (commlens.runconfig.RunConfig) or a user's config
    strategy    VARCHAR,           -- e.g. "ddp", "zero3", "tp2-sp", "dp2-tp2-pp2"
    world_size  INTEGER,
    created_at  TIMESTAMP NOT NULL DEFAULT current_timestamp,
    updated_at  TIMESTAMP NOT NULL DEFAULT current_timestamp
);

-- Every ingested file (archive members are files of their own: path "archive.tar.gz!member").
CREATE TABLE IF NOT EXISTS sources (
    source_id   INTEGER PRIMARY KEY DEFAULT nextval('source_id_seq'),
    run_id      INTEGER NOT NULL,
    path        VARCHAR NOT NULL,
    kind        VARCHAR NOT NULL,  -- kineto | nccl_log | run_config | unknown
    sha256      VARCHAR NOT NULL,
    size_bytes  BIGINT NOT NULL,
    rank        INTEGER,           -- global rank of a per-rank file; NULL for multi-rank logs or unknown
    world_size  INTEGER,
    status      VARCHAR NOT NULL,  -- ok | failed | duplicate
    error       VARCHAR,           -- "file:line: reason" or "file:$.json.path: reason"
    n_events    BIGINT NOT NULL DEFAULT 0,
    skipped     JSON,              -- {"reason": count}
    warnings    JSON,              -- ["..."]
    meta        JSON,              -- format generation, nccl/torch version, distributedInfo, ...
    ingested_at TIMESTAMP NOT NULL DEFAULT current_timestamp
);

-- Process groups (Kineto pg_config / event metadata, NCCL communicators, harness run.json groups).
CREATE TABLE IF NOT EXISTS process_groups (
    run_id            INTEGER NOT NULL,
    group_key         VARCHAR NOT NULL,  -- "pg:<name>" (PyTorch), "nccl:<commId|...>" (NCCL logs)
    name              VARCHAR,
    description       VARCHAR,
    backend           VARCHAR,
    ranks             INTEGER[],         -- global ranks, when known
    size              INTEGER,
    origin            VARCHAR NOT NULL,  -- pg_config | event | nccl_init | run_config
    mesh_dim          VARCHAR,           -- DeviceMesh dimension name when the source names one
    scheme            VARCHAR,           -- dp | tp | pp | cp | ep | other (filled by analysis)
    scheme_source     VARCHAR,           -- override | label | structure | unknown
    scheme_reason     VARCHAR,
    scheme_confidence DOUBLE,
    PRIMARY KEY (run_id, group_key)
);

-- One row per logical communication call per rank.
CREATE TABLE IF NOT EXISTS comm_events (
    run_id     INTEGER NOT NULL,
    source_id  INTEGER NOT NULL,
    rank       INTEGER,      -- global rank; NULL when the source does not tell
    process    VARCHAR,      -- the emitting process: "host:pid" (NCCL logs) or the trace's rank/file
    seq        BIGINT NOT NULL,  -- order of the call within its source and process
    op         VARCHAR NOT NULL, -- commlens op (commlens.vocab.OPS)
    dtype      VARCHAR,
    msg_bytes  BIGINT,       -- nccl-tests size S; NULL when the source gives no size
    elems_in   BIGINT,
    elems_out  BIGINT,
    group_size INTEGER,
    group_key  VARCHAR,
    peer       INTEGER,      -- send/recv: the peer's global rank (group rank when global is unknown)
    step       INTEGER,      -- profiler step (ProfilerStep#N) or detected iteration
    ts_us      DOUBLE,
    dur_us     DOUBLE,
    dur_source VARCHAR,      -- kernel | cpu_op | NULL
    op_count   BIGINT,       -- NCCL opCount
    comm_ptr   VARCHAR,      -- NCCL per-process communicator pointer
    raw_name   VARCHAR,      -- the source's own name for the call
    counted    BOOLEAN NOT NULL DEFAULT true  -- false: an NCCL-log call of a rank whose profiler trace in the
                                               -- same run describes the same calls (they count there, once)
);

-- Profiler steps (ProfilerStep#N) per rank.
CREATE TABLE IF NOT EXISTS steps (
    run_id    INTEGER NOT NULL,
    source_id INTEGER NOT NULL,
    rank      INTEGER,
    step      INTEGER NOT NULL,
    ts_us     DOUBLE,
    dur_us    DOUBLE
);

-- NCCL communicator members, one row per (process, communicator) Init line.
CREATE TABLE IF NOT EXISTS nccl_comms (
    run_id      INTEGER NOT NULL,
    source_id   INTEGER NOT NULL,
    group_key   VARCHAR NOT NULL,
    host        VARCHAR,
    pid         INTEGER,
    cuda_dev    INTEGER,
    comm_ptr    VARCHAR,
    comm_rank   INTEGER,   -- rank inside the communicator
    nranks      INTEGER,
    global_rank INTEGER,   -- through the world communicator, when known
    comm_id     VARCHAR,
    parent_ptr  VARCHAR,
    color       INTEGER,
    split_key   INTEGER,
    bus_id      VARCHAR,
    nvml_dev    INTEGER,
    api         VARCHAR,   -- ncclCommInitRank, ncclCommSplit, ...
    nccl_version VARCHAR
);

-- NCCL topology: rings, trees, channel counts, connections (transport) per communicator.
CREATE TABLE IF NOT EXISTS nccl_topology (
    run_id    INTEGER NOT NULL,
    source_id INTEGER NOT NULL,
    group_key VARCHAR,
    host      VARCHAR,
    pid       INTEGER,
    comm_ptr  VARCHAR,
    kind      VARCHAR NOT NULL,  -- ring | tree | nvls_tree | channels | connection | nodes
    channel   INTEGER,
    ranks     INTEGER[],         -- ring order; tree: [down0, down1, down2, self, up]
    src_rank  INTEGER,
    dst_rank  INTEGER,
    transport VARCHAR,           -- P2P/IPC, SHM/direct/direct, NET/IB/0/GDRDMA, ...
    detail    VARCHAR            -- the message text, for anything not in the columns
);

-- NCCL TUNING lines: algorithm and protocol chosen per size.
CREATE TABLE IF NOT EXISTS nccl_tuning (
    run_id    INTEGER NOT NULL,
    source_id INTEGER NOT NULL,
    host      VARCHAR,
    pid       INTEGER,
    op        VARCHAR,
    bytes     BIGINT,
    algo      VARCHAR,
    proto     VARCHAR,
    time_us   DOUBLE,
    channels  VARCHAR
);

CREATE TABLE IF NOT EXISTS users (
    user_id    INTEGER PRIMARY KEY DEFAULT nextval('user_id_seq'),
    name       VARCHAR NOT NULL UNIQUE,
    is_admin   BOOLEAN NOT NULL DEFAULT false,
    token_hash VARCHAR NOT NULL,
    created_at TIMESTAMP NOT NULL DEFAULT current_timestamp
);

-- Team review: items anchored to a run and a view; replies point at their parent item.
CREATE TABLE IF NOT EXISTS review_items (
    item_id    INTEGER PRIMARY KEY DEFAULT nextval('review_id_seq'),
    run_id     INTEGER NOT NULL,
    parent_id  INTEGER,
    author     VARCHAR NOT NULL,
    body       VARCHAR NOT NULL,   -- Markdown source, stored as text, rendered safely
    status     VARCHAR NOT NULL DEFAULT 'open',  -- open | resolved
    anchor     JSON,               -- {"view": ..., "scheme": ..., "op": ..., "bin": ..., "rank": ...}
    finding    VARCHAR,            -- id of a promoted finding
    created_at TIMESTAMP NOT NULL DEFAULT current_timestamp,
    updated_at TIMESTAMP NOT NULL DEFAULT current_timestamp
);

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

-- ------------------------------------------------------------------------------------------------
-- Per-run aggregates (schema version 2): derived from comm_events, steps and process_groups by
-- ingest/aggregates.py when a run's data or attribution changes (docs/store.md, "Aggregates").
-- Analyses read these instead of rescanning every call; only ingest/aggregates.py writes them.

-- Freshness and iteration mode of a run's aggregates.
CREATE TABLE IF NOT EXISTS agg_runs (
    run_id       INTEGER PRIMARY KEY,
    sources_fp   VARCHAR NOT NULL,  -- fingerprint of the run's ok sources when refreshed
    groups_fp    VARCHAR NOT NULL,  -- fingerprint of its process groups (scheme, backend, size) then
    calls        BIGINT NOT NULL,
    has_steps    BOOLEAN NOT NULL,  -- some source has profiler steps
    has_detected BOOLEAN NOT NULL,  -- some process without steps has a detected period
    refreshed_at TIMESTAMP NOT NULL DEFAULT current_timestamp
);

-- Sources with calls: rank key, whether they have profiler steps, and how many.
CREATE TABLE IF NOT EXISTS agg_sources (
    run_id     INTEGER NOT NULL,
    source_id  INTEGER NOT NULL,
    rank_key   VARCHAR,           -- global rank as text, else the process
    has_steps  BOOLEAN NOT NULL,
    iterations BIGINT,            -- with steps: distinct profiler steps (steps table or calls, the larger)
    calls      BIGINT NOT NULL
);

-- Iterations per rank key (profiler steps plus detected iterations).
CREATE TABLE IF NOT EXISTS agg_iterations (
    run_id     INTEGER NOT NULL,
    rank_key   VARCHAR NOT NULL,
    iterations BIGINT NOT NULL
);

-- Detected period of each communicator of each process of a source without profiler steps.
CREATE TABLE IF NOT EXISTS comm_periods (
    run_id       INTEGER NOT NULL,
    source_id    INTEGER NOT NULL,
    process      VARCHAR NOT NULL,
    comm         VARCHAR,           -- group_key, else 'ptr:' || comm_ptr
    group_key    VARCHAR,
    ord          INTEGER NOT NULL,  -- report order
    calls        BIGINT NOT NULL,
    period       INTEGER,           -- calls per repeating unit; NULL: no repetition
    offset_calls INTEGER,           -- calls before the repeating part (setup)
    repeats      INTEGER            -- complete repeating units
);

-- Iterations of each process of a source without profiler steps (NULL: no period).
CREATE TABLE IF NOT EXISTS process_iterations (
    run_id     INTEGER NOT NULL,
    source_id  INTEGER NOT NULL,
    process    VARCHAR NOT NULL,
    rank       INTEGER,
    iterations INTEGER,
    ord        INTEGER NOT NULL
);

-- The detected iteration of each call of a source without profiler steps.
CREATE TABLE IF NOT EXISTS comm_iterations (
    run_id    INTEGER NOT NULL,
    source_id INTEGER NOT NULL,
    process   VARCHAR NOT NULL,  -- coalesce(process, rank, '?') of the call
    seq       BIGINT NOT NULL,
    iteration INTEGER,           -- 0-based; NULL outside complete iterations
    reason    VARCHAR            -- why iteration is NULL
);

-- Calls per rank key, group, op, dtype, size, iteration membership and duration kind.
CREATE TABLE IF NOT EXISTS comm_agg (
    run_id              INTEGER NOT NULL,
    rank_key            VARCHAR NOT NULL,  -- coalesce(rank, process, '?')
    rank                INTEGER,
    group_key           VARCHAR,
    op                  VARCHAR NOT NULL,
    dtype               VARCHAR,
    msg_bytes           BIGINT,
    in_iteration        BOOLEAN NOT NULL,  -- inside a complete iteration (profiler step or detected)
    no_iteration_reason VARCHAR,
    dur_kind            VARCHAR,           -- kernel | cpu_op when dur_us > 0 from one of them, else NULL
    calls               BIGINT NOT NULL,
    sum_dur_us          DOUBLE,
    min_dur_us          DOUBLE,
    max_dur_us          DOUBLE,
    max_group_size      INTEGER,
    first_row           BIGINT             -- smallest comm_events rowid (first-seen order)
);

-- Bandwidth: calls without a usable measured duration, per reason.
CREATE TABLE IF NOT EXISTS bw_excluded (
    run_id INTEGER NOT NULL,
    reason VARCHAR NOT NULL,
    calls  BIGINT NOT NULL
);

-- Bandwidth per (op, size bin k = [2^k, 2^(k+1))): exact medians over the measured calls.
CREATE TABLE IF NOT EXISTS bw_bins (
    run_id            INTEGER NOT NULL,
    op                VARCHAR NOT NULL,
    k                 INTEGER NOT NULL,
    calls             BIGINT NOT NULL,
    median_bytes      DOUBLE,
    median_dur_us     DOUBLE,
    median_algbw_gbps DOUBLE,
    median_busbw_gbps DOUBLE,
    group_sizes       INTEGER[]
);

-- Bandwidth per op: best bin, half-bandwidth size, calls and time below it.
CREATE TABLE IF NOT EXISTS bw_ops (
    run_id                INTEGER NOT NULL,
    op                    VARCHAR NOT NULL,
    calls                 BIGINT NOT NULL,
    best_k                INTEGER,
    best_busbw_gbps       DOUBLE,
    half_k                INTEGER,
    half_bw_bytes         BIGINT,
    latency_bound_calls   BIGINT NOT NULL,
    latency_bound_time_us DOUBLE NOT NULL
);

-- Bandwidth per (scheme, op): exact medians (recomputed when the run's groups change).
CREATE TABLE IF NOT EXISTS bw_schemes (
    run_id                  INTEGER NOT NULL,
    scheme                  VARCHAR,
    op                      VARCHAR NOT NULL,
    calls                   BIGINT NOT NULL,
    time_us                 DOUBLE,
    median_busbw_gbps       DOUBLE,
    large_calls             BIGINT NOT NULL,
    large_median_busbw_gbps DOUBLE
);

-- The public contract: one row per logical collective call per rank.
CREATE OR REPLACE VIEW comms AS
SELECT
    r.name        AS run,
    e.rank        AS rank,
    e.op          AS op,
    e.dtype       AS dtype,
    e.msg_bytes   AS msg_bytes,
    e.elems_in    AS elems_in,
    e.elems_out   AS elems_out,
    e.group_size  AS group_size,
    e.group_key   AS group_key,
    g.scheme      AS scheme,
    e.peer        AS peer,
    e.step        AS step,
    e.ts_us       AS ts_us,
    e.dur_us      AS dur_us,
    s.kind        AS source_kind,
    s.path        AS file
FROM comm_events e
JOIN runs r ON r.run_id = e.run_id
JOIN sources s ON s.source_id = e.source_id
LEFT JOIN process_groups g ON g.run_id = e.run_id AND g.group_key = e.group_key
WHERE e.counted;
