-- console_namespaces --
-- Schedules per namespace and state (kept by triggers, see migration 0002).
SELECT namespace, state, schedules
FROM schedule_counts
WHERE state <> 'deleted' AND schedules > 0
ORDER BY namespace, state;

-- console_failures_since --
-- Failed occurrences per namespace finished since an instant (from the failures index alone).
SELECT namespace, count(*) AS failures
FROM executions
WHERE status IN ('retrying', 'dead') AND finished_at >= $1
GROUP BY namespace;

-- console_schedules --
-- A page of a namespace's live schedules in byte order of the id, between two bounds (a cursor
-- and an id prefix), containing the labels; each with its latest execution.
SELECT s.namespace, s.id, s.version, s.state, s.definition, s.compact, s.labels, s.fires,
       s.last_fire_at, s.next_fire_at, s.updated_at,
       e.status AS last_status, e.http_status AS last_http_status, e.error AS last_error,
       e.finished_at AS last_finished_at, e.lateness_ms AS last_lateness_ms
FROM (SELECT * FROM schedules
      WHERE namespace = $1 AND state <> 'deleted'
        AND (id COLLATE "C") > $2 AND (id COLLATE "C") >= $3 AND (id COLLATE "C") < $4
        AND labels @> $5::jsonb
      ORDER BY (id COLLATE "C")
      LIMIT $6) AS s
LEFT JOIN LATERAL (
    SELECT status, http_status, error, finished_at, lateness_ms FROM executions x
    WHERE x.namespace = s.namespace AND x.id = s.id
    ORDER BY x.nominal_at DESC LIMIT 1) AS e ON true
ORDER BY (s.id COLLATE "C");

-- console_schedules_in_state --
-- The same page, of one state only (its own index range).
SELECT s.namespace, s.id, s.version, s.state, s.definition, s.compact, s.labels, s.fires,
       s.last_fire_at, s.next_fire_at, s.updated_at,
       e.status AS last_status, e.http_status AS last_http_status, e.error AS last_error,
       e.finished_at AS last_finished_at, e.lateness_ms AS last_lateness_ms
FROM (SELECT * FROM schedules
      WHERE namespace = $1 AND state = $7
        AND (id COLLATE "C") > $2 AND (id COLLATE "C") >= $3 AND (id COLLATE "C") < $4
        AND labels @> $5::jsonb
      ORDER BY (id COLLATE "C")
      LIMIT $6) AS s
LEFT JOIN LATERAL (
    SELECT status, http_status, error, finished_at, lateness_ms FROM executions x
    WHERE x.namespace = s.namespace AND x.id = s.id
    ORDER BY x.nominal_at DESC LIMIT 1) AS e ON true
ORDER BY (s.id COLLATE "C");

-- console_schedule --
-- One schedule, any state.
SELECT namespace, id, version, state, definition, compact, labels, fires, last_fire_at,
       next_fire_at, created_at, updated_at
FROM schedules
WHERE namespace = $1 AND id = $2;

-- console_executions --
-- A schedule's executions before an instant, newest first.
SELECT nominal_at, is_trigger, is_backfill, attempts, status, http_status, error, started_at,
       finished_at, lateness_ms
FROM executions
WHERE namespace = $1 AND id = $2 AND nominal_at < $3
ORDER BY nominal_at DESC
LIMIT $4;

-- console_failures --
-- Failed occurrences across namespaces finished before an instant, newest first.
SELECT namespace, id, nominal_at, is_trigger, is_backfill, attempts, status, http_status,
       error, finished_at, lateness_ms
FROM executions
WHERE status IN ('retrying', 'dead') AND finished_at < $1
ORDER BY finished_at DESC
LIMIT $2;

-- console_commands --
-- The latest commands that named a schedule (the audit), newest first.
SELECT seq, received_at, verb, user_id, app_id, outcome, version
FROM commands
WHERE namespace = $1 AND schedule_id = $2
ORDER BY seq DESC
LIMIT $3;
