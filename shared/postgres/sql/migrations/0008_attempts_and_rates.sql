-- What the console needs to show retries and live rates (issue 27).

-- Every failed attempt of an occurrence, oldest first: {attempt, http_status, error,
-- started_ms, finished_ms}. The row itself keeps only the latest attempt, so a retry that
-- then succeeded left no trace of its failure. Appended by write_executions; most occurrences
-- succeed at once and keep the empty default, which costs no storage of its own.
ALTER TABLE executions ADD COLUMN failed_attempts jsonb NOT NULL DEFAULT '[]'::jsonb;

-- Occurrences with a failed attempt (dead, retrying, or retried and then succeeded), newest
-- first: the failures page walks it, per namespace or across them. Declared on the parent
-- only (no lock held while rows are read); each existing partition's index is then built
-- CONCURRENTLY and attached by the migrator (db.build_partition_indexes), so the executors
-- keep writing while a large table is indexed. New partitions get theirs when attached.
CREATE INDEX executions_retried ON ONLY executions (finished_at DESC, namespace)
    WHERE status IN ('retrying', 'dead') OR attempts > 1;

-- Deliveries per namespace and minute, added up by the executors' batched audit writes (one
-- more statement per batch), so the console's home page shows live rates without counting
-- executions. The sweeper drops minutes older than a day.
CREATE TABLE namespace_minutes (
    namespace        text        NOT NULL,
    minute           timestamptz NOT NULL,
    -- Occurrences whose first attempt started.
    fires            bigint      NOT NULL DEFAULT 0,
    succeeded        bigint      NOT NULL DEFAULT 0,
    -- Failed attempts, retried or not.
    failed_attempts  bigint      NOT NULL DEFAULT 0,
    dead             bigint      NOT NULL DEFAULT 0,
    PRIMARY KEY (namespace, minute)
);
CREATE INDEX namespace_minutes_minute ON namespace_minutes (minute);

-- The executors' audit flushes that committed, by the id each batch keeps until it is written:
-- a flush retried after its commit's answer was lost (the connection dropped, the writer was
-- cancelled at shutdown) finds its id and adds nothing twice. The sweeper drops old ids.
CREATE TABLE audit_flushes (
    id  uuid        PRIMARY KEY,
    at  timestamptz NOT NULL DEFAULT now()
);
