-- The console's reads (services/console): what keeps each page a few index lookups at
-- millions of schedules and tens of millions of executions.

-- A namespace's schedules in byte order of the id: one index range serves a page, and an id
-- prefix search is a range too (byte order makes every id with a prefix contiguous, which a
-- linguistic collation does not promise).
CREATE INDEX schedules_console_ids ON schedules (namespace, (id COLLATE "C"));
-- The same, within one state (the "paused" filter finds its few rows without a scan).
CREATE INDEX schedules_console_state ON schedules (namespace, state, (id COLLATE "C"));

-- Failed occurrences (the latest attempt failed), newest first: the failures page walks it,
-- and the namespaces page counts the last hour's entries per namespace from it alone.
CREATE INDEX executions_failures ON executions (finished_at DESC, namespace)
    WHERE status IN ('retrying', 'dead');

-- Schedules per namespace and state, kept by triggers: counting a million rows for every
-- view of the namespaces page would take longer than the whole page may.
CREATE TABLE schedule_counts (
    namespace  text   NOT NULL,
    state      text   NOT NULL,
    schedules  bigint NOT NULL,
    PRIMARY KEY (namespace, state)
);

INSERT INTO schedule_counts (namespace, state, schedules)
SELECT namespace, state, count(*) FROM schedules GROUP BY namespace, state;

-- Inserted rows, counted once per statement (a bulk import inserts thousands per statement).
CREATE FUNCTION schedule_counts_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO schedule_counts AS c (namespace, state, schedules)
    SELECT namespace, state, count(*) FROM inserted_rows
    GROUP BY namespace, state ORDER BY namespace, state
    ON CONFLICT (namespace, state) DO UPDATE SET schedules = c.schedules + EXCLUDED.schedules;
    RETURN NULL;
END $$;

-- A row that changed state (or went away) moves from one count to another.
CREATE FUNCTION schedule_counts_moved() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE schedule_counts SET schedules = schedules - 1
    WHERE namespace = OLD.namespace AND state = OLD.state;
    IF TG_OP = 'UPDATE' THEN
        INSERT INTO schedule_counts AS c (namespace, state, schedules)
        VALUES (NEW.namespace, NEW.state, 1)
        ON CONFLICT (namespace, state) DO UPDATE SET schedules = c.schedules + 1;
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER schedule_counts_on_insert AFTER INSERT ON schedules
    REFERENCING NEW TABLE AS inserted_rows
    FOR EACH STATEMENT EXECUTE FUNCTION schedule_counts_inserted();
-- The WHEN clause keeps checkpoint updates (the firing path) free of any trigger call.
CREATE TRIGGER schedule_counts_on_update AFTER UPDATE ON schedules
    FOR EACH ROW WHEN (OLD.state IS DISTINCT FROM NEW.state
                       OR OLD.namespace IS DISTINCT FROM NEW.namespace)
    EXECUTE FUNCTION schedule_counts_moved();
CREATE TRIGGER schedule_counts_on_delete AFTER DELETE ON schedules
    FOR EACH ROW EXECUTE FUNCTION schedule_counts_moved();
