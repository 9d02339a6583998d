-- Positions of the index (issue 21, invariant 9): an answered command is never undone by Redis.

-- Per shard of the index: `committed` counts the transactions that changed a schedule of the
-- shard (the intake takes the next one in the transaction of the change, so a shard's positions
-- commit in order and without gaps: a rollback takes its position back with it), `answered` the
-- highest position a reply said ok for. Redis keeps, per shard, the last position it applied
-- (`{s}:pos`); a dispatcher claims nothing from a shard whose position is below `answered`, and
-- the sweeper replays the rows after the shard's position.
CREATE TABLE index_positions (
    shard      integer PRIMARY KEY,
    committed  bigint  NOT NULL DEFAULT 0,
    answered   bigint  NOT NULL DEFAULT 0
);

-- The shard of a schedule (CRONBUS_SHARDS is fixed at install) and the position of the
-- transaction that changed it last: the rows a lagging index misses are those of its shard
-- past its position. Rows written before this migration (and by paths that are not commands)
-- keep position 0; drift repair looks after them as before.
ALTER TABLE schedules ADD COLUMN shard integer, ADD COLUMN position bigint NOT NULL DEFAULT 0;
CREATE INDEX schedules_shard_position ON schedules (shard, position) WHERE shard IS NOT NULL;
