-- commlens store schema, time part: the time analysis's results per run (docs/time.md defines every
-- quantity, docs/store.md every column). Written only by commlens.backend.timing.persist, all of a
-- run's rows in one transaction, recomputed at each ingest finalize and attribution change.
-- Times are µs; *_ref_us columns are on the run's reference clock (the lowest rank's, see
-- time_clock_offsets), others on the rank's own clock.

-- What the analysis of a run could not compute, and why (one row per part; ok rows say what was done).
CREATE TABLE IF NOT EXISTS time_status (
    run_id  INTEGER NOT NULL,
    part    VARCHAR NOT NULL,  -- matching | clocks | waits | breakdown | memcpy | stragglers | critical_path
    ok      BOOLEAN NOT NULL,  -- false: not computed (or only partly) for the reason given
    reason  VARCHAR NOT NULL,
    PRIMARY KEY (run_id, part, reason)
);

-- One collective instance: the same call matched on every member of its group.
-- time_instances and time_instance_members keep no primary key (schema 10): their keys are unique by
-- construction (instance_id numbers a run's instances 0.., one member row per rank), persist replaces a
-- run's rows whole, and reads prune by the insertion order; DuckDB's index on their millions of rows
-- was most of the time analysis of an NCCL log (docs/time.md).
CREATE TABLE IF NOT EXISTS time_instances (
    run_id         INTEGER NOT NULL,
    instance_id    INTEGER NOT NULL,  -- 0.. within the run, in (group_key, key) order
    group_key      VARCHAR NOT NULL,  -- process_groups.group_key, or 'world' for calls naming no group
    scheme         VARCHAR,           -- the group's scheme at the time of the analysis
    op             VARCHAR NOT NULL,
    dtype          VARCHAR,
    msg_bytes      BIGINT,            -- the lowest member's nccl-tests size S
    step           INTEGER,           -- the members' most common step
    match_key      BIGINT NOT NULL,   -- PyTorch Seq / NCCL opCount (keyed_by 'key') or position in the group's calls
    keyed_by       VARCHAR NOT NULL,  -- key | order
    members        INTEGER NOT NULL,
    first_arrival_ref_us DOUBLE,      -- NULL when a member has no start time or clocks are not trusted
    last_arrival_ref_us  DOUBLE,
    last_rank      INTEGER,           -- the member that arrived last
    skew_us        DOUBLE,            -- last arrival - first arrival
    real_us        DOUBLE,            -- end - arrival of the last member: the collective once all were there
    algbw_gbps     DOUBLE,            -- msg_bytes / real_us, GB/s (1e9 B)
    busbw_gbps     DOUBLE,            -- algbw x the nccl-tests factor for op and members
    last_own_us    DOUBLE             -- the members' waits less what last_rank inherited from other groups
);

-- Each member of an instance; (run_id, source_id, seq) is its comm_events row.
CREATE TABLE IF NOT EXISTS time_instance_members (
    run_id         INTEGER NOT NULL,
    instance_id    INTEGER NOT NULL,
    rank           INTEGER NOT NULL,
    source_id      INTEGER,
    seq            BIGINT NOT NULL,
    arrival_ref_us DOUBLE,            -- the call's start (device kernel, else CPU op), reference clock
    end_ref_us     DOUBLE,
    wait_us        DOUBLE            -- last arrival - own arrival (0 for the last)
);

-- Calls that could not be paired, with both sides (side_b NULL: the call is absent on rank_b).
CREATE TABLE IF NOT EXISTS time_mismatches (
    run_id    INTEGER NOT NULL,
    group_key VARCHAR NOT NULL,
    position  BIGINT NOT NULL,  -- the key (Seq, opCount) or the position in the group's call order
    reason    VARCHAR NOT NULL, -- missing on a member | ops disagree | dtypes disagree | sizes disagree
    rank_a    INTEGER NOT NULL,
    side_a    VARCHAR,          -- "seq N: op dtype bytes B"
    rank_b    INTEGER NOT NULL,
    side_b    VARCHAR
);

-- Calls left out of matching, their number per reason (send/recv, a group member without a trace, ...).
CREATE TABLE IF NOT EXISTS time_unmatched (
    run_id INTEGER NOT NULL,
    reason VARCHAR NOT NULL,
    calls  BIGINT NOT NULL,
    PRIMARY KEY (run_id, reason)
);

-- Clock offset per rank, estimated from the instances (docs/time.md, clock alignment).
CREATE TABLE IF NOT EXISTS time_clock_offsets (
    run_id     INTEGER NOT NULL,
    rank       INTEGER NOT NULL,
    domain     VARCHAR,           -- clock domain: the host, or "rank<N>" when hosts are unknown
    offset_us  DOUBLE NOT NULL,   -- added to the rank's times to put them on the reference clock (0: none)
    estimate_us DOUBLE,           -- the estimate for the domain, even when not applied; NULL: too little data
    spread_us  DOUBLE,            -- median absolute deviation of the end differences
    instances  INTEGER,           -- symmetric instances the estimate uses
    applied    BOOLEAN NOT NULL,  -- offsets are applied to the run
    trusted    BOOLEAN NOT NULL,  -- cross-rank differences (skew, wait, critical path) are meaningful
    reason     VARCHAR NOT NULL,
    PRIMARY KEY (run_id, rank)
);

-- Per rank, step and scheme: where each µs of the step went, each µs once (docs/time.md precedence).
-- scheme NULL: the whole step (the six categories sum to step_us). A scheme row splits the
-- communication categories by the scheme of the call covering them; its other columns are NULL.
-- Rows are stored in step-block order (commlens/store/layout.py: blocks of 256 steps, rank-major inside), so a
-- read of one step and a read of one rank both skip most row groups.
CREATE TABLE IF NOT EXISTS time_breakdown (
    run_id        INTEGER NOT NULL,
    rank          INTEGER NOT NULL,
    step          INTEGER NOT NULL,
    scheme        VARCHAR,        -- NULL = all; dp | tp | pp | cp | ep | other | unattributed
    step_us       DOUBLE,
    compute_us    DOUBLE,
    overlapped_us DOUBLE NOT NULL,
    wait_us       DOUBLE NOT NULL,
    exposed_us    DOUBLE NOT NULL,
    memcpy_us     DOUBLE,
    idle_us       DOUBLE
);

-- The memcpy lane per rank, step and direction: bytes of the copies starting in the step, the time
-- that direction's copies run (union), and bytes / that time.
-- Stored in the same step-block order as time_breakdown.
CREATE TABLE IF NOT EXISTS time_memcpy (
    run_id    INTEGER NOT NULL,
    rank      INTEGER NOT NULL,
    step      INTEGER NOT NULL,
    direction VARCHAR NOT NULL,  -- htod | dtoh | dtod | ptop | memset
    bytes     BIGINT NOT NULL,
    busy_us   DOUBLE NOT NULL,
    gbps      DOUBLE,            -- bytes / busy_us in GB/s; NULL when busy_us is 0
    PRIMARY KEY (run_id, rank, step, direction)
);

-- Per rank over its profiled steps (the report's time.ranks).
CREATE TABLE IF NOT EXISTS time_rank_totals (
    run_id        INTEGER NOT NULL,
    rank          INTEGER NOT NULL,
    steps         INTEGER NOT NULL,  -- profiled steps of the rank
    instances     INTEGER NOT NULL,  -- matched instances with arrival times the rank is a member of
    arrived_last  INTEGER NOT NULL,
    wait_us       DOUBLE NOT NULL,   -- its waits summed
    imposed_us    DOUBLE NOT NULL,   -- the others' waits in the instances it arrived last in
    step_us       DOUBLE,            -- its steps' durations summed; NULL without steps
    exposed_us    DOUBLE,            -- exposed communication (wait + exposed) over its steps
    overlapped_us DOUBLE,
    PRIMARY KEY (run_id, rank)
);

-- Per group and rank: arrivals (the straggler evidence).
CREATE TABLE IF NOT EXISTS time_arrivals (
    run_id            INTEGER NOT NULL,
    group_key         VARCHAR NOT NULL,
    scheme            VARCHAR,
    rank              INTEGER NOT NULL,
    instances         INTEGER NOT NULL,
    arrived_last      INTEGER NOT NULL,
    imposed_us        DOUBLE NOT NULL,
    wait_us           DOUBLE NOT NULL,
    steps             INTEGER NOT NULL,  -- steps of the group with instances
    steps_mostly_last INTEGER NOT NULL,  -- steps in which the rank was last in >= the rule's share
    PRIMARY KEY (run_id, group_key, rank)
);

-- One verdict per group: its straggler (rank not NULL) or why there is none.
CREATE TABLE IF NOT EXISTS time_stragglers (
    run_id              INTEGER NOT NULL,
    group_key           VARCHAR NOT NULL,
    scheme              VARCHAR,
    straggler           BOOLEAN NOT NULL,
    rank                INTEGER,          -- the straggler; NULL when none is named
    candidate_rank      INTEGER,          -- the most frequent last arrival the verdict weighed
    arrived_last_share  DOUBLE,
    steps_mostly_last   INTEGER,
    steps               INTEGER,
    imposed_us_per_step DOUBLE,
    instances           INTEGER,
    reason              VARCHAR NOT NULL,
    PRIMARY KEY (run_id, group_key)
);

-- The critical path of each step across ranks: totals per step (reference clock).
CREATE TABLE IF NOT EXISTS time_critical_path (
    run_id        INTEGER NOT NULL,
    step          INTEGER NOT NULL,
    start_ref_us  DOUBLE NOT NULL,
    end_ref_us    DOUBLE NOT NULL,
    compute_us    DOUBLE,
    overlapped_us DOUBLE,
    wait_us       DOUBLE,
    exposed_us    DOUBLE,
    memcpy_us     DOUBLE,
    idle_us       DOUBLE,
    note          VARCHAR,           -- why the path is not across ranks, when it is not
    PRIMARY KEY (run_id, step)
);

-- The path's segments, latest first as the walk finds them.
CREATE TABLE IF NOT EXISTS time_critical_segments (
    run_id       INTEGER NOT NULL,
    step         INTEGER NOT NULL,
    seg          INTEGER NOT NULL,   -- 0 = the segment ending at the step's end
    rank         INTEGER NOT NULL,
    start_ref_us DOUBLE NOT NULL,
    end_ref_us   DOUBLE NOT NULL,
    kind         VARCHAR NOT NULL,   -- work | collective
    instance_id  INTEGER,            -- time_instances row of a collective segment
    PRIMARY KEY (run_id, step, seg)
);

-- Exposed communication (wait + exposed) on the path per scheme, as a share of the step.
CREATE TABLE IF NOT EXISTS time_critical_schemes (
    run_id        INTEGER NOT NULL,
    step          INTEGER NOT NULL,
    scheme        VARCHAR NOT NULL,
    exposed_share DOUBLE NOT NULL,
    PRIMARY KEY (run_id, step, scheme)
);

-- The timing findings' inputs (backend/findings.py store_timing_inputs, written after the tables above):
-- each finding's quantity per (rank, step) summarised per rank, so a findings request reads O(keys x ranks)
-- rows. kind: exposed, wait (key = scheme), memcpy (key ''), straggler (key = group_key: the waits of the
-- others), wait_dominated (key = scheme, with op).
CREATE TABLE IF NOT EXISTS time_finding_cells (
    run_id   INTEGER NOT NULL,
    kind     VARCHAR NOT NULL,
    key      VARCHAR NOT NULL,
    op       VARCHAR NOT NULL,  -- '' except for wait_dominated
    rank     INTEGER NOT NULL,
    cells    BIGINT NOT NULL,   -- the rank's (rank, step) cells
    value_us DOUBLE NOT NULL,   -- their values summed
    m2_us2   DOUBLE NOT NULL,   -- squared deviations of the values from the rank's mean, summed
    step_us  DOUBLE,            -- the cells' step times summed (the mean step per cell for waits)
    weak     BOOLEAN NOT NULL,  -- some cell is under the findings' minimum share of its step
    dur_us   DOUBLE,            -- wait_dominated: the members' time inside the collective
    PRIMARY KEY (run_id, kind, key, op, rank)
);

-- Per kind and key: the steps the cells span, the instances a finding links (largest skews first) and,
-- for wait_dominated, its number of instances and the rank whose late arrivals caused most of the wait.
CREATE TABLE IF NOT EXISTS time_finding_keys (
    run_id        INTEGER NOT NULL,
    kind          VARCHAR NOT NULL,
    key           VARCHAR NOT NULL,
    op            VARCHAR NOT NULL,
    n_steps       INTEGER NOT NULL,
    steps         INTEGER[] NOT NULL,
    instances     BIGINT,
    top_instances INTEGER[],
    cause_rank    INTEGER,
    cause_wait_us DOUBLE,
    PRIMARY KEY (run_id, kind, key, op)
);

-- Per run: its profiled steps (from `steps`: (rank, step) pairs, ranks, the mean of each pair's longest
-- duration) and the memcpy lane's totals per direction, as the findings read them.
CREATE TABLE IF NOT EXISTS time_finding_runs (
    run_id       INTEGER PRIMARY KEY,
    rank_steps   BIGINT NOT NULL,
    ranks        BIGINT NOT NULL,
    mean_step_us DOUBLE,
    htod_bytes   HUGEINT,
    htod_busy_us DOUBLE,
    dtoh_bytes   HUGEINT,
    dtoh_busy_us DOUBLE
);
