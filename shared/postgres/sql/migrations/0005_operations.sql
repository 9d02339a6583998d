-- Per-schedule stats and the auto-pause mark, kept apart from `schedules` so that the
-- executor's batched writes never contend with a command's row lock.

CREATE TABLE schedule_stats (
    namespace             text        NOT NULL,
    id                    text        NOT NULL,
    -- Occurrences whose first attempt started (regular and triggered).
    fires                 bigint      NOT NULL DEFAULT 0,
    succeeded             bigint      NOT NULL DEFAULT 0,
    -- Failed attempts (each one, retried or not).
    failed                bigint      NOT NULL DEFAULT 0,
    -- Occurrences that failed their last attempt.
    dead                  bigint      NOT NULL DEFAULT 0,
    -- Missed occurrences the misfire policy dropped.
    skipped               bigint      NOT NULL DEFAULT 0,
    -- Nominal times spec.exclude stepped over.
    excluded              bigint      NOT NULL DEFAULT 0,
    -- Occurrences ended dead since the last success.
    consecutive_failures  bigint      NOT NULL DEFAULT 0,
    last_status           text,
    last_error            text,
    -- Start of the latest attempt.
    last_fire_at          timestamptz,
    -- The schedule version pause_after_failures paused (any later command clears the mark).
    paused_version        bigint,
    PRIMARY KEY (namespace, id)
);
