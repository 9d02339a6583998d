-- console_namespaces --
-- Schedules per namespace and state (kept by triggers, see migration 0002).
SELECT namespace, state, schedules
FROM schedule_counts
WHERE state <> 'deleted' AND schedules > 0
ORDER BY namespace, state;

-- console_namespace_known --
-- Whether the home page lists a namespace: a schedule in it that is not deleted, or deliveries
-- since $2 (an hour ago). Two primary-key lookups.
SELECT EXISTS (SELECT 1 FROM schedule_counts
               WHERE namespace = $1 AND state <> 'deleted' AND schedules > 0)
    OR EXISTS (SELECT 1 FROM namespace_minutes WHERE namespace = $1 AND minute >= $2) AS known;

-- console_schedules --
-- A page of a namespace's live schedules in byte order of the id, between two bounds (a cursor
-- and an id prefix), containing the labels; each with its latest execution.
SELECT s.namespace, s.id, s.version, s.state, s.definition, s.compact, s.labels, s.fires,
       s.last_fire_at, s.next_fire_at, s.updated_at,
       e.status AS last_status, e.http_status AS last_http_status, e.error AS last_error,
       e.finished_at AS last_finished_at, e.lateness_ms AS last_lateness_ms,
       (SELECT to_jsonb(t) - 'namespace' - 'id' - 'paused_version' FROM schedule_stats t
        WHERE t.namespace = s.namespace AND t.id = s.id) AS stats
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
       e.finished_at AS last_finished_at, e.lateness_ms AS last_lateness_ms,
       (SELECT to_jsonb(t) - 'namespace' - 'id' - 'paused_version' FROM schedule_stats t
        WHERE t.namespace = s.namespace AND t.id = s.id) AS stats
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
SELECT s.namespace, s.id, s.version, s.state, s.definition, s.compact, s.labels, s.fires,
       s.last_fire_at, s.next_fire_at, s.created_at, s.updated_at,
       to_jsonb(t) - 'namespace' - 'id' - 'paused_version' AS stats,
       CASE WHEN s.state <> 'paused' THEN NULL
            WHEN t.paused_version = s.version THEN 'failures' ELSE 'command' END AS paused_reason
FROM schedules s
LEFT JOIN schedule_stats t ON t.namespace = s.namespace AND t.id = s.id
WHERE s.namespace = $1 AND s.id = $2;

-- console_executions --
-- A schedule's executions before an instant, newest first.
SELECT nominal_at, is_trigger, is_backfill, attempts, status, http_status, error, started_at,
       finished_at, lateness_ms, failed_attempts
FROM executions
WHERE namespace = $1 AND id = $2 AND nominal_at < $3
ORDER BY nominal_at DESC
LIMIT $4;

-- console_failures --
-- Occurrences with a failed attempt (dead, retrying, or retried and then succeeded) across
-- namespaces, or in one ($3, empty: all), finished before an instant, newest first
-- (executions_retried).
SELECT namespace, id, nominal_at, is_trigger, is_backfill, attempts, status, http_status,
       error, started_at, finished_at, lateness_ms, failed_attempts
FROM executions
WHERE (status IN ('retrying', 'dead') OR attempts > 1) AND finished_at < $1
  AND ($3 = '' OR namespace = $3)
ORDER BY finished_at DESC
LIMIT $2;

-- console_rates --
-- Deliveries per namespace (kept by the executors' audit writes): the last hour's since $1, the
-- recent ones since $2 (whole minutes before the current one, which counts so far), and the
-- namespace's first recorded minute, from which its rates are taken when it is later than $2
-- (services.console.views.rate_window_start). One primary-key lookup per namespace.
WITH hour AS (
    SELECT namespace, minute, fires, failed_attempts, dead FROM namespace_minutes
    WHERE minute >= $1
)
SELECT h.namespace,
       (SELECT min(x.minute) FROM namespace_minutes x WHERE x.namespace = h.namespace)
           AS first_minute,
       sum(h.fires) FILTER (WHERE h.minute >= $2) AS recent_fires,
       sum(h.failed_attempts) FILTER (WHERE h.minute >= $2) AS recent_failed,
       sum(h.fires) AS hour_fires, sum(h.failed_attempts) AS hour_failed, sum(h.dead) AS hour_dead
FROM hour AS h
GROUP BY h.namespace;

-- console_commands --
-- The latest commands that named a schedule to change it (the audit, reads left out), newest
-- first.
SELECT seq, received_at, verb, user_id, app_id, outcome, version
FROM commands
WHERE namespace = $1 AND schedule_id = $2 AND verb NOT IN ('get', 'list')
ORDER BY seq DESC
LIMIT $3;
