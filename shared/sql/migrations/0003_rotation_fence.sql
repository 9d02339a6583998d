-- Checkpoints fenced by rotation, and the generation of the Redis index.

-- The version at which the schedule's current rotation started. A change that restarts the
-- rotation (fires back to 0, no last fire) moves it; a checkpoint written by an occurrence of
-- an older rotation (its audit batch landed late) is refused instead of overwriting the new one.
ALTER TABLE schedules ADD COLUMN rotation_version bigint;
UPDATE schedules SET rotation_version = version;
ALTER TABLE schedules ALTER COLUMN rotation_version SET NOT NULL;

CREATE FUNCTION cronbus_rotation_version() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        NEW.rotation_version := COALESCE(NEW.rotation_version, NEW.version);
    ELSIF NEW.version <> OLD.version AND NEW.fires = 0 AND NEW.last_fire_at IS NULL THEN
        NEW.rotation_version := NEW.version;
    END IF;
    RETURN NEW;
END;
$$;

CREATE TRIGGER schedules_rotation_version
    BEFORE INSERT OR UPDATE ON schedules
    FOR EACH ROW EXECUTE FUNCTION cronbus_rotation_version();

-- The generation of the Redis index. The sweeper moves it forward every sweep, in Redis first
-- and then here; a Redis whose generation is behind this one was restored from an older
-- snapshot, and is rebuilt.
CREATE TABLE index_generation (
    singleton   boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    generation  bigint  NOT NULL
);
INSERT INTO index_generation (generation) VALUES (0);
