-- Checkpoints fenced by rotation, and the generation of the Redis index.

-- The version at which the schedule's current rotation started. A change that starts a new
-- rotation (the writer says so) moves it; a pause, a resume or a change that keeps the fire
-- times does not. A checkpoint written by an occurrence of an older rotation (its audit batch
-- landed late) is refused instead of overwriting the new one.
-- NULL: no rotation start recorded (every checkpoint is taken).
ALTER TABLE schedules ADD COLUMN rotation_version bigint;
UPDATE schedules SET rotation_version = version;

-- The generation of the Redis index. The sweeper moves it forward every sweep, in Redis first
-- and then here; a Redis whose generation is behind this one was restored from an older
-- snapshot, and is rebuilt.
CREATE TABLE index_generation (
    singleton   boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    generation  bigint  NOT NULL
);
INSERT INTO index_generation (generation) VALUES (0);
