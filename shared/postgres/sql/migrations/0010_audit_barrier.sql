-- The audit barrier: a rebuild of a lost index reads the checkpoints only once every live
-- executor has written the completions Redis acknowledged before it lost its data.

-- The latest barrier a rebuild asked for.
CREATE TABLE audit_barrier (
    singleton  boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    requested  bigint  NOT NULL
);
INSERT INTO audit_barrier (requested) VALUES (0);

-- Per executor process: the latest barrier it answered (every completion it had begun to
-- settle when it read that request is written), and when it was last heard of. A writer not
-- heard of for a few seconds is taken for dead: its unwritten rows are lost with it.
CREATE TABLE audit_writers (
    writer    text        PRIMARY KEY,
    answered  bigint      NOT NULL,
    seen_at   timestamptz NOT NULL DEFAULT now()
);
