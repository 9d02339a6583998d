-- get_schedule --
-- One schedule (any state).
SELECT namespace, id, version, state, definition, compact, priority, labels, fires,
       last_fire_at, next_fire_at, created_at, updated_at
FROM schedules
WHERE namespace = $1 AND id = $2;

-- get_schedules_and_audit --
-- Many schedules (any namespaces, any state) and the audit rows of the gets that asked.
WITH audit AS (
    INSERT INTO commands (namespace, verb, schedule_id, user_id, app_id, message_id,
                          correlation_id, body, outcome, error, version, reply)
    SELECT * FROM unnest($3::text[], $4::text[], $5::text[], $6::text[], $7::text[],
                         $8::text[], $9::text[], $10::jsonb[], $11::text[], $12::jsonb[],
                         $13::bigint[], $14::jsonb[])
)
-- backfill_remaining: what PostgreSQL keeps of a running backfill (shown while Redis lost it).
SELECT s.namespace, s.id, s.version, s.state, s.definition, s.compact, s.priority, s.labels,
       s.fires, s.last_fire_at, s.next_fire_at, s.created_at, s.updated_at,
       b.remaining AS backfill_remaining
FROM schedules s
LEFT JOIN backfills b ON b.namespace = s.namespace AND b.id = s.id
WHERE (s.namespace, s.id) IN (SELECT * FROM unnest($1::text[], $2::text[]));

-- lock_schedule --
-- One schedule, locked until the command's transaction ends.
SELECT namespace, id, version, state, definition, compact, priority, labels, fires,
       last_fire_at, next_fire_at, created_at, updated_at
FROM schedules
WHERE namespace = $1 AND id = $2
FOR UPDATE;

-- put_schedule --
-- Create or replace a schedule at the version the caller computed under the row lock.
-- $12: the version when a new rotation starts, else NULL (the rotation goes on).
INSERT INTO schedules AS s (namespace, id, version, state, definition, compact, priority,
                            labels, fires, last_fire_at, next_fire_at, rotation_version)
VALUES ($1, $2, $3, $4, $5::jsonb, $6, $7, $8::jsonb, $9, to_timestamp($10::bigint / 1000.0),
        to_timestamp($11::bigint / 1000.0), $12::bigint)
ON CONFLICT (namespace, id) DO UPDATE
SET version = EXCLUDED.version, state = EXCLUDED.state, definition = EXCLUDED.definition,
    compact = EXCLUDED.compact, priority = EXCLUDED.priority, labels = EXCLUDED.labels,
    fires = EXCLUDED.fires, last_fire_at = EXCLUDED.last_fire_at,
    next_fire_at = EXCLUDED.next_fire_at,
    rotation_version = COALESCE(EXCLUDED.rotation_version, s.rotation_version), updated_at = now(),
    created_at = CASE WHEN s.state = 'deleted' THEN now() ELSE s.created_at END
RETURNING namespace, id, version, state, definition, compact, priority, labels, fires,
          last_fire_at, next_fire_at, created_at, updated_at;

-- list_schedules --
-- A page of a namespace's schedules in id order, after the cursor, filtered by labels and state.
SELECT namespace, id, version, state, definition, compact, priority, labels, fires,
       last_fire_at, next_fire_at, created_at, updated_at
FROM schedules
WHERE namespace = $1
  AND state <> 'deleted'
  AND ($2::text IS NULL OR state = $2)
  AND labels @> $3::jsonb
  AND id > $4
ORDER BY id
LIMIT $5;

-- record_command --
-- The audit of one command, whatever its outcome.
INSERT INTO commands (namespace, verb, schedule_id, user_id, app_id, message_id,
                      correlation_id, body, outcome, error, version, reply)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8::jsonb, $9, $10::jsonb, $11, $12::jsonb);

-- lock_schedule_key_names --
-- The keys of schedules a batch writes, stored or not (FOR UPDATE locks no row for one not
-- stored yet: two creations of it would both pass), in one order (no deadlock).
SELECT pg_advisory_xact_lock(hashtextextended('cronbus-schedule:' || k.ns || '/' || k.id, 0))
FROM (SELECT * FROM unnest($1::text[], $2::text[]) AS u(ns, id) ORDER BY 1, 2) AS k;

-- lock_schedule_keys --
-- Schedules of any namespaces, locked until the transaction ends, and the transaction's
-- timestamp (what now() writes as updated_at): one row with NULLs when none is stored yet.
WITH locked AS (
    SELECT namespace, id, version, state, definition, compact, priority, labels, fires,
           last_fire_at, next_fire_at, created_at, updated_at
    FROM schedules
    WHERE (namespace, id) IN (SELECT * FROM unnest($1::text[], $2::text[]))
    ORDER BY namespace, id
    FOR UPDATE
)
SELECT floor(extract(epoch FROM now()) * 1000)::bigint AS txn_now_ms, locked.*
FROM (SELECT 1) AS one LEFT JOIN locked ON true;

-- put_schedules_and_audit --
-- Group commit: create or replace the schedules and write the commands' audit rows, in one
-- statement. A NULL rotation_version keeps the stored one (the rotation goes on).
WITH put AS (
    INSERT INTO schedules AS s (namespace, id, version, state, definition, compact, priority,
                                labels, fires, last_fire_at, next_fire_at, rotation_version)
    SELECT r.namespace, r.id, r.version, r.state, r.definition, r.compact, r.priority, r.labels,
           r.fires, to_timestamp(r.last_fire_ms / 1000.0), to_timestamp(r.next_fire_ms / 1000.0),
           r.rotation_version
    FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[], $5::jsonb[], $6::bytea[],
                $7::int[], $8::jsonb[], $9::bigint[], $10::bigint[], $11::bigint[],
                $12::bigint[])
         AS r(namespace, id, version, state, definition, compact, priority, labels, fires,
              last_fire_ms, next_fire_ms, rotation_version)
    ON CONFLICT (namespace, id) DO UPDATE
    SET version = EXCLUDED.version, state = EXCLUDED.state, definition = EXCLUDED.definition,
        compact = EXCLUDED.compact, priority = EXCLUDED.priority, labels = EXCLUDED.labels,
        fires = EXCLUDED.fires, last_fire_at = EXCLUDED.last_fire_at,
        next_fire_at = EXCLUDED.next_fire_at,
        rotation_version = COALESCE(EXCLUDED.rotation_version, s.rotation_version),
        updated_at = now(),
        created_at = CASE WHEN s.state = 'deleted' THEN now() ELSE s.created_at END
), audit AS (
    INSERT INTO commands (namespace, verb, schedule_id, user_id, app_id, message_id,
                          correlation_id, body, outcome, error, version, reply)
    SELECT * FROM unnest($13::text[], $14::text[], $15::text[], $16::text[], $17::text[],
                         $18::text[], $19::text[], $20::jsonb[], $21::text[], $22::jsonb[],
                         $23::bigint[], $24::jsonb[])
)
SELECT 1;

-- applied_commands --
-- The commands last applied under any of these message ids (group commit's replay check; the
-- caller keeps the rows of its own namespaces).
SELECT DISTINCT ON (namespace, message_id) namespace, message_id, verb, body, reply
FROM commands
WHERE message_id = ANY($1::text[]) AND outcome = 'ok' AND verb NOT IN ('get', 'list')
ORDER BY namespace, message_id, seq DESC;

-- command_recorded --
-- Whether an audit row carries this message id (a bulk import's batch: did it commit?).
SELECT EXISTS (SELECT 1 FROM commands WHERE message_id = $1);

-- applied_command --
-- The command last applied under a message id in a namespace (a redelivery is answered).
SELECT verb, body, reply FROM commands
WHERE message_id = $2 AND namespace = $1 AND outcome = 'ok' AND verb NOT IN ('get', 'list')
ORDER BY seq DESC
LIMIT 1;

-- execution_exists --
-- Whether an occurrence (regular, or a trigger) left an execution row (a backfilled delivery's
-- row is not the occurrence's own).
SELECT EXISTS (SELECT 1 FROM executions
               WHERE namespace = $1 AND id = $2 AND nominal_at = to_timestamp($3 / 1000.0)
                 AND is_trigger = $4 AND NOT is_backfill);

-- write_executions --
-- A batch of execution rows; a later attempt of the same occurrence replaces an earlier one,
-- adding its failed attempts to the log (once each, whatever the order rows arrive in). Lateness is the first attempt's: from the due time
-- to its start (a retry's backoff is not lateness). A backfilled delivery has its own row
-- beside the regular occurrence's.
INSERT INTO executions AS e (namespace, id, nominal_at, is_trigger, is_backfill, attempts,
                             status, http_status, error, idempotency_key, started_at,
                             finished_at, lateness_ms, failed_attempts)
SELECT r.namespace, r.id, to_timestamp(r.nominal_ms / 1000.0), r.is_trigger, r.is_backfill,
       r.attempts, r.status, r.http_status, r.error, r.idempotency_key,
       to_timestamp(r.started_ms / 1000.0), to_timestamp(r.finished_ms / 1000.0),
       r.lateness_ms, r.failed_attempts::jsonb
FROM unnest($1::text[], $2::text[], $3::bigint[], $4::boolean[], $5::int[], $6::text[],
            $7::int[], $8::text[], $9::text[], $10::bigint[], $11::bigint[], $12::boolean[],
            $13::bigint[], $14::text[])
     AS r(namespace, id, nominal_ms, is_trigger, attempts, status, http_status, error,
          idempotency_key, started_ms, finished_ms, is_backfill, lateness_ms, failed_attempts)
ON CONFLICT (namespace, id, nominal_at, is_trigger, is_backfill) DO UPDATE
SET attempts = GREATEST(e.attempts, EXCLUDED.attempts),
    status = CASE WHEN e.attempts <= EXCLUDED.attempts THEN EXCLUDED.status ELSE e.status END,
    http_status = CASE WHEN e.attempts <= EXCLUDED.attempts THEN EXCLUDED.http_status
                       ELSE e.http_status END,
    error = CASE WHEN e.attempts <= EXCLUDED.attempts THEN EXCLUDED.error ELSE e.error END,
    started_at = CASE WHEN e.attempts <= EXCLUDED.attempts THEN EXCLUDED.started_at
                      ELSE e.started_at END,
    finished_at = CASE WHEN e.attempts <= EXCLUDED.attempts THEN EXCLUDED.finished_at
                       ELSE e.finished_at END,
    -- An earlier attempt's row may arrive last (another executor flushed later): it still
    -- brings the first attempt's lateness and its failure.
    lateness_ms = LEAST(e.lateness_ms, EXCLUDED.lateness_ms),
    -- One entry per attempt whatever the order or how often a flush is retried.
    failed_attempts = (
        SELECT COALESCE(jsonb_agg(a.entry ORDER BY a.attempt), '[]'::jsonb)
        FROM (SELECT DISTINCT ON ((entry ->> 'attempt')::int)
                     (entry ->> 'attempt')::int AS attempt, entry
              FROM jsonb_array_elements(e.failed_attempts || EXCLUDED.failed_attempts) AS entry
              ORDER BY (entry ->> 'attempt')::int) AS a);

-- write_checkpoints --
-- A batch of rotation checkpoints: the latest completed nominal fire of the current rotation
-- wins. A counted checkpoint carries the rotation's total of fires; an uncounted one (the
-- index keeps no count without max_fires) what its occurrences add, even when a checkpoint
-- of a later fire got here first (another executor flushed sooner).
UPDATE schedules AS s
SET last_fire_at = CASE WHEN c.newer THEN to_timestamp(c.last_ms / 1000.0)
                        ELSE s.last_fire_at END,
    next_fire_at = CASE WHEN NOT c.newer THEN s.next_fire_at
                        WHEN c.next_ms IS NULL THEN NULL
                        ELSE to_timestamp(c.next_ms / 1000.0) END,
    fires = CASE WHEN c.counted THEN GREATEST(s.fires, c.fires) ELSE s.fires + c.fires END,
    state = CASE WHEN c.newer AND c.finished AND s.state = 'active' THEN 'completed'
                 ELSE s.state END
FROM (SELECT u.*, (t.last_fire_at IS NULL
                   OR t.last_fire_at <= to_timestamp(u.last_ms / 1000.0)) AS newer
      FROM unnest($1::text[], $2::text[], $3::bigint[], $4::bigint[], $5::bigint[],
                  $6::boolean[], $7::bigint[], $8::boolean[])
           AS u(namespace, id, last_ms, next_ms, fires, finished, version, counted)
      JOIN schedules t ON t.namespace = u.namespace AND t.id = u.id) AS c
WHERE s.namespace = c.namespace AND s.id = c.id
  -- An occurrence of an older rotation (the schedule was reset since) checkpoints nothing.
  AND c.version >= COALESCE(s.rotation_version, 0)
  AND (c.newer OR NOT c.counted AND c.fires > 0);

-- recent_executions --
-- The latest executions of one schedule.
SELECT nominal_at, is_trigger, is_backfill, attempts, status, http_status, error,
       idempotency_key, started_at, finished_at, lateness_ms
FROM executions
WHERE namespace = $1 AND id = $2
ORDER BY nominal_at DESC
LIMIT $3;

-- analyze_schedules --
ANALYZE schedules;

-- live_priority_below --
-- The highest priority under $1 that a live schedule has (the rebuild's stream walks the
-- priorities down, one at a time; schedules_rebuild answers it from its first entry).
SELECT max(priority) FROM schedules
WHERE state IN ('active', 'paused') AND priority < $1::bigint;

-- live_schedules_page --
-- The next page of the live schedules at one priority, in key order after ($2, $3). A keyset
-- page on schedules_rebuild: PostgreSQL reads it from the index in order whatever its
-- statistics say, where a whole-table ORDER BY was planned as a sort of every row.
SELECT namespace, id, version, state, compact, fires,
       (extract(epoch FROM last_fire_at) * 1000)::bigint AS last_fire_ms,
       (extract(epoch FROM next_fire_at) * 1000)::bigint AS next_fire_ms
FROM schedules
WHERE state IN ('active', 'paused') AND priority = $1
  AND (namespace, id) > ($2::text, $3::text)
ORDER BY namespace, id
LIMIT $4;

-- live_versions_after --
-- The versions of the next slice of live schedules, in key order after ($1, $2): the full
-- drift comparison reads whole rows only for the entries missing from the index or behind it.
SELECT namespace, id, version
FROM schedules
WHERE (namespace, id) > ($1::text, $2::text) AND state IN ('active', 'paused')
ORDER BY namespace, id
LIMIT $3;

-- amqp_targets_after --
-- The next page of live schedules with an AMQP target, in key order after ($1, $2): what
-- cronbus doctor and the sweeper at start check against CRONBUS_AMQP_ALLOWED_EXCHANGES.
SELECT namespace, id, state, definition -> 'target' ->> 'exchange' AS exchange
FROM schedules
WHERE (namespace, id) > ($1::text, $2::text) AND state IN ('active', 'paused')
  AND definition -> 'target' ->> 'kind' = 'amqp'
ORDER BY namespace, id
LIMIT $3;

-- schedule_states --
-- The state and version of the given schedules (index entries without a live row are
-- orphans, and so are those older than a completed row).
SELECT s.namespace, s.id, s.state, s.version
FROM schedules s
JOIN unnest($1::text[], $2::text[]) AS k(namespace, id)
  ON s.namespace = k.namespace AND s.id = k.id;

-- changed_schedules --
-- Schedules a command changed since an instant (drift repair's recent window).
SELECT namespace, id, version, state, compact, fires,
       (extract(epoch FROM last_fire_at) * 1000)::bigint AS last_fire_ms,
       (extract(epoch FROM next_fire_at) * 1000)::bigint AS next_fire_ms
FROM schedules
WHERE updated_at >= to_timestamp($1::bigint / 1000.0);

-- schedule_versions --
-- Version and state of the given schedules (drift repair checks index entries against them).
SELECT s.namespace, s.id, s.version, s.state, s.compact, s.fires,
       (extract(epoch FROM s.last_fire_at) * 1000)::bigint AS last_fire_ms,
       (extract(epoch FROM s.next_fire_at) * 1000)::bigint AS next_fire_ms
FROM schedules s
JOIN unnest($1::text[], $2::text[]) AS k(namespace, id)
  ON s.namespace = k.namespace AND s.id = k.id;

-- lock_schedules --
-- Many schedules of a namespace, locked until the transaction ends (bulk import).
SELECT namespace, id, version, state, definition, compact, priority, labels, fires,
       last_fire_at, next_fire_at, created_at, updated_at
FROM schedules
WHERE namespace = $1 AND id = ANY($2::text[])
FOR UPDATE;

-- create_schedule_staging --
-- A transaction-local staging table for COPY (bulk import).
CREATE TEMPORARY TABLE IF NOT EXISTS schedule_staging (
    namespace text, id text, version bigint, state text, definition text, compact bytea,
    priority integer, labels text, fires bigint, last_fire_ms bigint, next_fire_ms bigint,
    rotation_version bigint
) ON COMMIT DELETE ROWS;

-- put_staged_schedules --
-- Create or replace every staged schedule at the version the importer computed. With $1
-- (fenced), a row is replaced only from an older version: one another transaction created
-- after the importer looked (its lock covers rows that exist, not rows yet to come) is left
-- alone, and the caller, which counts the rows written, tries again.
INSERT INTO schedules AS s (namespace, id, version, state, definition, compact, priority,
                            labels, fires, last_fire_at, next_fire_at, rotation_version)
SELECT namespace, id, version, state, definition::jsonb, compact, priority, labels::jsonb,
       fires, to_timestamp(last_fire_ms / 1000.0), to_timestamp(next_fire_ms / 1000.0),
       rotation_version
FROM schedule_staging
ON CONFLICT (namespace, id) DO UPDATE
SET version = EXCLUDED.version, state = EXCLUDED.state, definition = EXCLUDED.definition,
    compact = EXCLUDED.compact, priority = EXCLUDED.priority, labels = EXCLUDED.labels,
    fires = EXCLUDED.fires, last_fire_at = EXCLUDED.last_fire_at,
    next_fire_at = EXCLUDED.next_fire_at,
    rotation_version = COALESCE(EXCLUDED.rotation_version, s.rotation_version), updated_at = now(),
    created_at = CASE WHEN s.state = 'deleted' THEN now() ELSE s.created_at END
WHERE NOT $1::boolean OR s.version < EXCLUDED.version;

-- write_stats --
-- A batch of per-schedule stats deltas folded from execution rows (one statement per batch).
INSERT INTO schedule_stats AS s (namespace, id, fires, succeeded, failed, dead, skipped,
                                 excluded, consecutive_failures, last_status, last_error,
                                 last_fire_at)
SELECT d.namespace, d.id, d.fires, d.succeeded, d.failed, d.dead, d.skipped, d.excluded,
       d.trailing_dead, d.last_status, d.last_error, to_timestamp(d.last_ms / 1000.0)
FROM unnest($1::text[], $2::text[], $3::bigint[], $4::bigint[], $5::bigint[], $6::bigint[],
            $7::bigint[], $8::bigint[], $9::bigint[], $10::text[], $11::text[], $12::bigint[])
     AS d(namespace, id, fires, succeeded, failed, dead, skipped, excluded, trailing_dead,
          last_status, last_error, last_ms)
ON CONFLICT (namespace, id) DO UPDATE
SET fires = s.fires + EXCLUDED.fires, succeeded = s.succeeded + EXCLUDED.succeeded,
    failed = s.failed + EXCLUDED.failed, dead = s.dead + EXCLUDED.dead,
    skipped = s.skipped + EXCLUDED.skipped, excluded = s.excluded + EXCLUDED.excluded,
    -- A success in the batch resets the run; the batch's dead after its last success add up.
    consecutive_failures = CASE
        WHEN EXCLUDED.succeeded > 0 THEN EXCLUDED.consecutive_failures
        ELSE s.consecutive_failures + EXCLUDED.consecutive_failures END,
    last_status = CASE WHEN EXCLUDED.last_fire_at IS NULL
                         OR EXCLUDED.last_fire_at < s.last_fire_at
                       THEN s.last_status ELSE EXCLUDED.last_status END,
    last_error = CASE WHEN EXCLUDED.last_fire_at IS NULL
                        OR EXCLUDED.last_fire_at < s.last_fire_at
                      THEN s.last_error ELSE EXCLUDED.last_error END,
    last_fire_at = GREATEST(s.last_fire_at, EXCLUDED.last_fire_at);

-- write_minutes --
-- Deliveries per namespace and minute, added up (one statement per audit batch).
INSERT INTO namespace_minutes AS m (namespace, minute, fires, succeeded, failed_attempts, dead)
SELECT d.namespace, to_timestamp(d.minute_ms / 1000.0), d.fires, d.succeeded,
       d.failed_attempts, d.dead
FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::bigint[], $5::bigint[], $6::bigint[])
     AS d(namespace, minute_ms, fires, succeeded, failed_attempts, dead)
ON CONFLICT (namespace, minute) DO UPDATE
SET fires = m.fires + EXCLUDED.fires, succeeded = m.succeeded + EXCLUDED.succeeded,
    failed_attempts = m.failed_attempts + EXCLUDED.failed_attempts, dead = m.dead + EXCLUDED.dead;

-- trim_minutes --
-- Minutes the console no longer shows.
DELETE FROM namespace_minutes WHERE minute < $1;

-- claim_audit_flush --
-- An audit flush's id, taken in its own transaction: no row back means that flush committed
-- already (its retry writes nothing).
INSERT INTO audit_flushes (id) VALUES ($1) ON CONFLICT DO NOTHING RETURNING true;

-- trim_audit_flushes --
DELETE FROM audit_flushes WHERE at < $1;

-- answer_audit_barrier --
-- An executor is alive and has answered barrier $2; returns the latest barrier asked for.
INSERT INTO audit_writers (writer, answered, seen_at) VALUES ($1, $2, now())
ON CONFLICT (writer) DO UPDATE
SET answered = GREATEST(audit_writers.answered, EXCLUDED.answered), seen_at = now()
RETURNING (SELECT requested FROM audit_barrier);

-- forget_audit_writer --
DELETE FROM audit_writers WHERE writer = $1;

-- request_audit_barrier --
UPDATE audit_barrier SET requested = requested + 1 RETURNING requested;

-- audit_writers_behind --
-- The writers that have not answered barrier $1 and were heard of within the last $2 seconds
-- (they heartbeat twice a second, beside their flushes, until their last rows are written).
SELECT writer FROM audit_writers
WHERE answered < $1 AND seen_at > now() - make_interval(secs => $2::double precision)
ORDER BY writer;

-- trim_audit_writers --
DELETE FROM audit_writers WHERE seen_at < $1;

-- schedule_stats --
-- The stats of the given schedules of a namespace (get and list).
SELECT id, fires, succeeded, failed, dead, skipped, excluded, consecutive_failures,
       last_status, last_error, last_fire_at, paused_version
FROM schedule_stats
WHERE namespace = $1 AND id = ANY($2::text[]);

-- reset_stats --
-- A schedule created anew (or again after a delete) starts with empty stats.
DELETE FROM schedule_stats WHERE namespace = $1 AND id = $2;

-- reset_stats_many --
-- Schedules created anew (or again after a delete) start with empty stats.
DELETE FROM schedule_stats AS s
USING unnest($1::text[], $2::text[]) AS c(namespace, id)
WHERE s.namespace = c.namespace AND s.id = c.id;

-- mark_paused_for_failures --
-- The version pause_after_failures paused (get and list show paused_reason "failures").
INSERT INTO schedule_stats AS s (namespace, id, paused_version)
VALUES ($1, $2, $3)
ON CONFLICT (namespace, id) DO UPDATE SET paused_version = EXCLUDED.paused_version;

-- lock_message_ids --
-- Commands carrying these (namespace, message_id) wait for each other until the transaction
-- ends: two copies, or two commands reusing one id, cannot both find it unused. Locked in one
-- order (no deadlock); the check that follows is a statement of its own (a fresh snapshot).
SELECT pg_advisory_xact_lock(hashtextextended('cronbus-message:' || m.ns || ':' || m.mid, 0))
FROM (SELECT * FROM unnest($1::text[], $2::text[]) AS u(ns, mid) ORDER BY 1, 2) AS m;

-- lock_namespace_creations --
-- The lock that serialises creations in a namespace (two creations racing cannot both pass
-- the quota). A statement of its own: under READ COMMITTED a statement's snapshot is taken
-- when it starts, so a count in the same statement would miss a creation committed while
-- this one waited for the lock.
SELECT pg_advisory_xact_lock(hashtextextended('cronbus-quota:' || $1, 0));

-- count_live_schedules --
-- A namespace's schedules that are not deleted, counted for max_schedules (after
-- lock_namespace_creations, in a statement of its own).
SELECT count(*) AS live FROM schedules WHERE namespace = $1 AND state <> 'deleted';

-- index_generation --
-- The generation the Redis index must be at (or ahead of).
SELECT generation FROM index_generation;

-- advance_index_generation --
-- Record the generation Redis was moved to (never backwards).
UPDATE index_generation SET generation = GREATEST(generation, $1::bigint);

-- clock_ms --
-- PostgreSQL's clock (ms): drift repair's windows are measured on the clock that stamps rows.
SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint;

-- add_pending_run --
-- An occurrence outside the rotation, kept until its run completes (with the command's audit);
-- no row back when that occurrence is pending already.
INSERT INTO pending_runs (namespace, id, kind, nominal_ms)
VALUES ($1, $2, $3, $4)
ON CONFLICT DO NOTHING
RETURNING nominal_ms;

-- drop_pending_runs --
-- Every pending run of a schedule (it is deleted); returns what was dropped.
DELETE FROM pending_runs WHERE namespace = $1 AND id = $2
RETURNING namespace, id, kind, nominal_ms;

-- finish_pending_runs --
-- Runs that completed (succeeded or dead) are no longer pending (with their execution rows).
DELETE FROM pending_runs AS p
USING unnest($1::text[], $2::text[], $3::text[], $4::bigint[]) AS f(namespace, id, kind, nominal_ms)
WHERE p.namespace = f.namespace AND p.id = f.id AND p.kind = f.kind
  AND p.nominal_ms = f.nominal_ms;

-- pending_run_exists --
-- Whether a run is still pending.
SELECT EXISTS (SELECT 1 FROM pending_runs
               WHERE namespace = $1 AND id = $2 AND kind = $3 AND nominal_ms = $4);

-- live_pending_runs --
-- Every pending run of a schedule that is not deleted, with what the index needs of it
-- (the rebuild's stream, after the schedules).
SELECT p.namespace, p.id, p.kind, p.nominal_ms, s.version, s.state, s.compact
FROM pending_runs p
JOIN schedules s ON s.namespace = p.namespace AND s.id = p.id
WHERE s.state <> 'deleted'
ORDER BY p.nominal_ms;

-- old_pending_runs --
-- Pending runs accepted before an instant, oldest first (drift repair checks the index has them).
SELECT p.namespace, p.id, p.kind, p.nominal_ms, s.version, s.state, s.compact
FROM pending_runs p
JOIN schedules s ON s.namespace = p.namespace AND s.id = p.id
WHERE s.state <> 'deleted' AND p.created_at < to_timestamp($1::bigint / 1000.0)
ORDER BY p.created_at
LIMIT $2;

-- next_backfill_generation --
-- A generation newer than the schedule's running backfill's (under the schedule's row lock).
SELECT GREATEST($3::bigint,
                COALESCE((SELECT generation + 1 FROM backfills WHERE namespace = $1 AND id = $2),
                         0));

-- put_backfill --
-- Start a schedule's backfill, replacing the one it has.
INSERT INTO backfills AS b (namespace, id, generation, from_ms, to_ms, limit_count, next_ms,
                            remaining)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
ON CONFLICT (namespace, id) DO UPDATE
SET generation = EXCLUDED.generation, from_ms = EXCLUDED.from_ms, to_ms = EXCLUDED.to_ms,
    limit_count = EXCLUDED.limit_count, next_ms = EXCLUDED.next_ms,
    remaining = EXCLUDED.remaining, created_at = now();

-- drop_backfill --
-- A schedule's backfill, gone (replaced by one with nothing to deliver, or its schedule deleted).
DELETE FROM backfills WHERE namespace = $1 AND id = $2;

-- advance_backfills --
-- A batch of backfill completions that go on: only the generation that completed moves, and
-- only forward.
UPDATE backfills AS b
SET next_ms = p.next_ms, remaining = p.remaining
FROM unnest($1::text[], $2::text[], $3::bigint[], $4::bigint[], $5::int[])
     AS p(namespace, id, generation, next_ms, remaining)
WHERE b.namespace = p.namespace AND b.id = p.id AND b.generation = p.generation
  AND b.remaining > p.remaining;

-- end_backfills --
-- Backfills whose last occurrence completed (only the generation that completed).
DELETE FROM backfills AS b
USING unnest($1::text[], $2::text[], $3::bigint[]) AS p(namespace, id, generation)
WHERE b.namespace = p.namespace AND b.id = p.id AND b.generation = p.generation;

-- end_backfills_of_schedules --
-- The backfills of schedules that completed (their rotation is over: the backfill ends too).
-- Only where the schedule is completed now: a late checkpoint of a rotation since restarted
-- leaves the new rotation's backfill alone.
DELETE FROM backfills AS b
USING unnest($1::text[], $2::text[]) AS f(namespace, id), schedules AS s
WHERE b.namespace = f.namespace AND b.id = f.id
  AND s.namespace = b.namespace AND s.id = b.id AND s.state = 'completed';

-- live_backfills --
-- Every backfill of a schedule in rotation or paused (the rebuild's stream).
SELECT b.namespace, b.id, b.generation, b.to_ms, b.next_ms, b.remaining, s.state
FROM backfills b
JOIN schedules s ON s.namespace = b.namespace AND s.id = b.id
WHERE s.state IN ('active', 'paused')
ORDER BY b.created_at;

-- kept_backfill --
-- One schedule's backfill, if it has one and is in rotation or paused (a redelivered backfill
-- command puts it back into an index that never got it).
SELECT b.namespace, b.id, b.generation, b.to_ms, b.next_ms, b.remaining, s.state
FROM backfills b
JOIN schedules s ON s.namespace = b.namespace AND s.id = b.id
WHERE b.namespace = $1 AND b.id = $2 AND s.state IN ('active', 'paused');

-- old_backfills --
-- Backfills started before an instant (drift repair checks the index has them).
SELECT b.namespace, b.id, b.generation, b.to_ms, b.next_ms, b.remaining, s.state
FROM backfills b
JOIN schedules s ON s.namespace = b.namespace AND s.id = b.id
WHERE s.state IN ('active', 'paused') AND b.created_at < to_timestamp($1::bigint / 1000.0)
ORDER BY b.created_at
LIMIT $2;

-- take_positions --
-- The next position of each shard a group commit changes ($1: the shards, sorted, so that two
-- transactions lock them in one order), and every changed row stamped with its shard's
-- ($2, $3, $4: namespace, id, shard). The rows stay locked until the commit: a shard's
-- positions commit in order. Returns (shard, position).
WITH taken AS (
    INSERT INTO index_positions AS p (shard, committed)
    SELECT s, 1 FROM unnest($1::int[]) AS s ORDER BY s
    ON CONFLICT (shard) DO UPDATE SET committed = p.committed + 1
    RETURNING p.shard, p.committed
), stamped AS (
    UPDATE schedules AS s SET shard = r.shard, position = t.committed
    FROM unnest($2::text[], $3::text[], $4::int[]) AS r(namespace, id, shard)
    JOIN taken AS t ON t.shard = r.shard
    WHERE s.namespace = r.namespace AND s.id = r.id
)
SELECT shard, committed FROM taken;

-- mark_answered --
-- Positions whose command is about to be answered ok ($1 shards, $2 positions). The rows are
-- locked in shard order first, as take_positions locks them (no deadlock between the two).
WITH locked AS (
    SELECT shard FROM index_positions WHERE shard = ANY($1::int[]) ORDER BY shard FOR UPDATE
)
UPDATE index_positions AS p SET answered = GREATEST(p.answered, r.position)
FROM unnest($1::int[], $2::bigint[]) AS r(shard, position), locked
WHERE p.shard = r.shard AND locked.shard = r.shard;

-- index_positions --
-- Every shard's committed and answered positions.
SELECT shard, committed, answered FROM index_positions;

-- changed_after_positions --
-- The rows of these shards changed after each shard's position ($1 shards, $2 positions),
-- oldest change first: what an index at those positions lacks.
SELECT s.namespace, s.id, s.version, s.state, s.compact, s.fires,
       (extract(epoch FROM s.last_fire_at) * 1000)::bigint AS last_fire_ms,
       (extract(epoch FROM s.next_fire_at) * 1000)::bigint AS next_fire_ms
FROM unnest($1::int[], $2::bigint[]) AS r(shard, position)
JOIN schedules AS s ON s.shard = r.shard AND s.position > r.position
ORDER BY s.position;

-- runs_after_positions --
-- The pending runs of live schedules of these shards whose own position is after the shard's
-- ($1 shards, $2 positions): an index at those positions may lack them. Returns each run's
-- position with it.
SELECT p.namespace, p.id, p.kind, p.nominal_ms, p.position, s.version, s.state, s.compact
FROM unnest($1::int[], $2::bigint[]) AS r(shard, position)
JOIN schedules AS s ON s.shard = r.shard
JOIN pending_runs AS p ON p.namespace = s.namespace AND p.id = s.id AND p.position > r.position
WHERE s.state <> 'deleted'
ORDER BY p.position;

-- backfills_after_positions --
-- The backfills of schedules in rotation or paused of these shards whose own position is after
-- the shard's ($1 shards, $2 positions): an index at those positions may lack them.
SELECT b.namespace, b.id, b.generation, b.to_ms, b.next_ms, b.remaining, b.position, s.state
FROM unnest($1::int[], $2::bigint[]) AS r(shard, position)
JOIN schedules AS s ON s.shard = r.shard
JOIN backfills AS b ON b.namespace = s.namespace AND b.id = s.id AND b.position > r.position
WHERE s.state IN ('active', 'paused')
ORDER BY b.position;

-- stamp_run_position --
-- A pending run's position ($1 namespace, $2 id, $3 kind, $4 nominal_ms, $5 position), taken in
-- the transaction that added it.
UPDATE pending_runs SET position = $5
WHERE namespace = $1 AND id = $2 AND kind = $3 AND nominal_ms = $4;

-- stamp_backfill_position --
-- A backfill's position ($1 namespace, $2 id, $3 position), taken in the transaction that
-- started it.
UPDATE backfills SET position = $3 WHERE namespace = $1 AND id = $2;

-- database_identity --
-- Which database this is: the cluster's system identifier and the database's name (the index
-- records it, so that an index of another database is never fired).
SELECT (SELECT system_identifier::text FROM pg_control_system()) || '/' || current_database();

-- notify_answered --
-- Tells every dispatcher, at the commit, of positions just answered ($1 channel, $2 payload
-- `shard:position,...`): they fence their claims with them at once.
SELECT pg_notify($1, $2);

-- positions_of_schedules --
-- Per shard, the position of the last change of these schedules ($1 namespaces, $2 ids): a
-- command found applied already is answered again, and its change may not be in Redis yet.
SELECT s.shard, max(s.position) AS position
FROM unnest($1::text[], $2::text[]) AS r(namespace, id)
JOIN schedules AS s ON s.namespace = r.namespace AND s.id = r.id
WHERE s.shard IS NOT NULL AND s.position > 0
GROUP BY s.shard;

-- compact_page --
-- Schedules after ($1, $2) in key order, $3 at most: their compact values (the form rewrite).
SELECT namespace, id, version, compact
FROM schedules
WHERE (namespace, id) > ($1, $2)
ORDER BY namespace, id
LIMIT $3;

-- rewrite_compact --
-- The compact values of these schedules in another form, each only at the version it was read
-- at: a command that wrote the schedule since wrote its value in its own services' form.
UPDATE schedules AS s
SET compact = r.compact
FROM unnest($1::text[], $2::text[], $3::bigint[], $4::bytea[]) AS r(namespace, id, version, compact)
WHERE s.namespace = r.namespace AND s.id = r.id AND s.version = r.version;
