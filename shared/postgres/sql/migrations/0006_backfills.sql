-- cronbus: backfills are durable (kept until they complete, so they survive the loss of Redis).

-- A schedule's running backfill: its nominal occurrences in [from_ms, to_ms), oldest first, one
-- at a time. At most one per schedule: a new backfill replaces the row (and a newer
-- generation). Written with the command's audit row; moved on by the executors' batched writes
-- (next_ms, remaining), removed when it ends, when its schedule is deleted or completes.
CREATE TABLE backfills (
    namespace    text        NOT NULL,
    id           text        NOT NULL,
    -- Grows with every backfill command of the schedule: completions of an older generation
    -- (a replaced backfill's occurrence in flight) never move a newer one.
    generation   bigint      NOT NULL,
    from_ms      bigint      NOT NULL,
    to_ms        bigint      NOT NULL,
    limit_count  integer     NOT NULL,
    -- The nominal time of the occurrence due or in flight (where a rebuild resumes).
    next_ms      bigint      NOT NULL,
    -- Occurrences left to deliver, that one included.
    remaining    integer     NOT NULL CHECK (remaining > 0),
    created_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (namespace, id)
);

-- Drift repair looks for old backfills the index has lost.
CREATE INDEX backfills_created ON backfills (created_at);

-- A backfilled delivery replays the regular occurrence at its instant (same key, same fire
-- time) but is another delivery: it gets its own execution row, so the regular occurrence's
-- outcome and attempts stay as they were and the replay's own outcome is kept beside them.
ALTER TABLE executions ADD COLUMN is_backfill boolean NOT NULL DEFAULT false;
ALTER TABLE executions DROP CONSTRAINT executions_occurrence_key;
ALTER TABLE executions
    ADD CONSTRAINT executions_occurrence_key
    UNIQUE (namespace, id, nominal_at, is_trigger, is_backfill);
