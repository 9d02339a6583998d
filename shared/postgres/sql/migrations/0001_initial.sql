-- cronbus: schedules (the truth), executions (one row per occurrence), commands (an audit).

CREATE TABLE schedules (
    namespace     text        NOT NULL,
    id            text        NOT NULL,
    -- Bumped by every command that changes the schedule; a deleted schedule keeps its row
    -- (state 'deleted') so versions keep increasing if it is created again.
    version       bigint      NOT NULL,
    state         text        NOT NULL
                  CHECK (state IN ('active', 'paused', 'completed', 'deleted')),
    -- The schedule as the user sent it, with every default filled in.
    definition    jsonb       NOT NULL,
    -- The exact value the Redis index stores (shared.compact), so a rebuild need not re-validate.
    compact       bytea       NOT NULL,
    priority      integer     NOT NULL DEFAULT 0,
    labels        jsonb       NOT NULL DEFAULT '{}'::jsonb,
    -- Regular occurrences fired so far (for max_fires), last nominal fire, next nominal fire.
    fires         bigint      NOT NULL DEFAULT 0,
    last_fire_at  timestamptz,
    next_fire_at  timestamptz,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (namespace, id)
);

CREATE INDEX schedules_labels ON schedules USING gin (labels jsonb_path_ops);
-- Drift repair looks at the schedules commands changed recently.
CREATE INDEX schedules_updated ON schedules (updated_at);
-- A rebuild streams the live schedules, highest priority first.
CREATE INDEX schedules_rebuild ON schedules (priority DESC, namespace, id)
    WHERE state IN ('active', 'paused');

CREATE TABLE executions (
    namespace        text        NOT NULL,
    id               text        NOT NULL,
    nominal_at       timestamptz NOT NULL,
    is_trigger       boolean     NOT NULL DEFAULT false,
    attempts         integer     NOT NULL,
    -- succeeded | retrying (an attempt failed, another will follow) | dead | skipped (misfire)
    status           text        NOT NULL,
    http_status      integer,
    error            text,
    idempotency_key  text        NOT NULL,
    started_at       timestamptz NOT NULL,
    finished_at      timestamptz NOT NULL,
    -- Start of the last attempt minus the nominal fire time.
    lateness_ms      bigint      NOT NULL,
    UNIQUE (namespace, id, nominal_at)
) PARTITION BY RANGE (nominal_at);

-- Catches rows outside the daily partitions the sweeper keeps ahead (never loses a row).
CREATE TABLE executions_default PARTITION OF executions DEFAULT;

CREATE TABLE commands (
    seq             bigserial   PRIMARY KEY,
    received_at     timestamptz NOT NULL DEFAULT now(),
    namespace       text,
    verb            text,
    schedule_id     text,
    -- Who sent it, from the AMQP properties when present.
    user_id         text,
    app_id          text,
    message_id      text,
    correlation_id  text,
    body            jsonb,
    -- ok, or the error code of the reply.
    outcome         text        NOT NULL,
    error           jsonb,
    -- The schedule version the command produced.
    version         bigint,
    -- The reply given (a redelivered command with the same message_id gets it again).
    reply           jsonb
);

CREATE INDEX commands_schedule ON commands (namespace, schedule_id, seq);
-- A redelivered command (same message_id) is answered, not applied twice.
CREATE INDEX commands_message ON commands (message_id) WHERE message_id IS NOT NULL;
