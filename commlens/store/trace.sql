-- commlens store schema, trace part: runs, sources, process groups, calls, steps, NCCL rows, and the
-- public `comms` view. Written by commlens.store.writer; docs/store.md documents every table.
-- Upgrades are explicit: commlens/store/migrations.py (schema version and steps).

CREATE SEQUENCE IF NOT EXISTS run_id_seq START 1;
CREATE SEQUENCE IF NOT EXISTS source_id_seq START 1;

-- One training job (or one upload of traces that belong together).
CREATE TABLE IF NOT EXISTS runs (
    run_id      INTEGER PRIMARY KEY DEFAULT nextval('run_id_seq'),
    name        VARCHAR NOT NULL UNIQUE,
    description VARCHAR,
    tags        VARCHAR[] NOT NULL DEFAULT [],
    config      JSON,              -- harness run.json (commlens.run_json.RunConfig) or a user's config
    strategy    VARCHAR,           -- e.g. "ddp", "zero3", "tp2-sp", "dp2-tp2-pp2"
    world_size  INTEGER,
    created_at  TIMESTAMP NOT NULL DEFAULT current_timestamp,
    updated_at  TIMESTAMP NOT NULL DEFAULT current_timestamp,
    owner_id    INTEGER            -- users.user_id of its creator; NULL: created by the CLI or a tokenless caller
);

-- A run's former names: links holding one still reach the run. No run is named like another run's alias.
CREATE TABLE IF NOT EXISTS run_aliases (
    alias      VARCHAR PRIMARY KEY,
    run_id     INTEGER NOT NULL,
    created_at TIMESTAMP NOT NULL DEFAULT current_timestamp
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
    match_key    BIGINT,     -- the source's own instance counter: PyTorch's collective Seq (Kineto), NCCL opCount
    cpu_start_us DOUBLE,     -- the call's CPU op (Kineto), rank's own clock
    cpu_end_us   DOUBLE,
    dev_start_us DOUBLE,     -- first device kernel start / last kernel end of the call; NULL without kernels
    dev_end_us   DOUBLE,
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

-- Activity of a rank as intervals (what the time analysis reads): device kernels, memcpy and memset per
-- stream; for traces without device activity (gloo) the collectives' CPU time and the other CPU ops.
-- Intervals of one kind on one stream that touch or overlap are merged (their bytes add up).
CREATE TABLE IF NOT EXISTS timeline_intervals (
    run_id    INTEGER NOT NULL,
    source_id INTEGER NOT NULL,
    rank      INTEGER,
    kind      VARCHAR NOT NULL,  -- compute | comm | memcpy_htod | memcpy_dtoh | memcpy_dtod | memcpy_ptop | memset
    stream    BIGINT NOT NULL,   -- device stream; CPU-only traces: thread id (-1: the collectives' lane)
    start_us  DOUBLE NOT NULL,   -- rank's own clock
    end_us    DOUBLE NOT NULL,
    nbytes    BIGINT NOT NULL DEFAULT 0  -- memcpy/memset bytes; 0 otherwise
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
