-- commlens store schema, all-to-all pairs: the bytes each all_to_all call sends to each member of its group,
-- from the call's input split list (Kineto `In split size`, gloo's alltoall_base_ arguments). Written by
-- commlens.store.writer with the file's comm_events; read by commlens.service.pairs; docs/store.md.

-- One row per (all_to_all call, group member); calls without a recorded split list have none.
CREATE TABLE IF NOT EXISTS a2a_pairs (
    run_id    INTEGER NOT NULL,
    source_id INTEGER NOT NULL,
    rank      INTEGER,           -- the sender's global rank (comm_events.rank)
    seq       BIGINT NOT NULL,   -- the call's comm_events.seq in the same source
    peer      INTEGER NOT NULL,  -- the receiver's rank in the call's group (its place in the split list)
    bytes     BIGINT NOT NULL    -- bytes sent to that receiver (the sender's own row included)
);
