-- commlens store schema, review part: users and their review items (commlens.service).
-- Upgrades are explicit: commlens/store/migrations.py (schema version and steps).

CREATE SEQUENCE IF NOT EXISTS review_id_seq START 1;
CREATE SEQUENCE IF NOT EXISTS user_id_seq START 1;

-- Ids are never reused: authorship and ownership are bound to them, so a new user given a deleted user's
-- name gets none of the old user's items or runs.
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
    author     VARCHAR NOT NULL,   -- the author's name when written (shown once the user is deleted)
    body       VARCHAR NOT NULL,   -- Markdown source, stored as text, rendered safely
    status     VARCHAR NOT NULL DEFAULT 'open',  -- open | resolved
    anchor     JSON,               -- {"view": ..., "scheme": ..., "op": ..., "bin": ..., "rank": ...}
    finding    VARCHAR,            -- id of a promoted finding
    created_at TIMESTAMP NOT NULL DEFAULT current_timestamp,
    updated_at TIMESTAMP NOT NULL DEFAULT current_timestamp,
    author_id  INTEGER             -- users.user_id; NULL for the tokenless local user and anonymous writers
);
