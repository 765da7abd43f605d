-- commlens store schema, aggregates part (schema version 2): derived from comm_events, steps and
-- process_groups by commlens/store/aggregates.py when a run's data or attribution changes (docs/store.md,
-- "Aggregates"). Analyses read these instead of rescanning every call; only commlens/store/aggregates.py writes them.
-- Upgrades are explicit: commlens/store/migrations.py (schema version and steps).

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
