-- cronbus: extra occurrences outside the rotation are durable; a trigger has its own identity.

-- Occurrences accepted outside the rotation (a trigger; a backfill's occurrences later), kept
-- from the command that accepted them until their run completes (succeeded or dead), so a
-- rebuild of a lost Redis index restores them. Written in the same transaction as the
-- command's audit row; removed in the same batch as the execution rows that finish them.
CREATE TABLE pending_runs (
    namespace   text        NOT NULL,
    id          text        NOT NULL,
    kind        text        NOT NULL CHECK (kind IN ('trigger', 'backfill')),
    -- The occurrence's nominal time in ms: the trigger time, or a backfilled nominal fire.
    nominal_ms  bigint      NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (namespace, id, kind, nominal_ms)
);

-- Drift repair looks for old pending runs the index has lost.
CREATE INDEX pending_runs_created ON pending_runs (created_at);

-- A triggered run at the instant of a regular occurrence is another occurrence: it gets its
-- own execution row. (A unique key of a partitioned table must hold the partition key.)
ALTER TABLE executions DROP CONSTRAINT executions_namespace_id_nominal_at_key;
ALTER TABLE executions
    ADD CONSTRAINT executions_occurrence_key UNIQUE (namespace, id, nominal_at, is_trigger);
