-- Positions of runs outside the rotation (issue 34, invariant 9): a trigger and a backfill take
-- their shard's position in the transaction that makes them durable, as every change of a
-- schedule does, and each row keeps its own. The intake writes the run and the position to
-- Redis at once (`lua/run.lua`, `lua/backfill.lua`); the sweeper's replay of a shard that lacks
-- the position writes it from here, and neither writes it once the position is applied. Rows
-- written before this migration keep position 0; drift repair looks after them as before.
ALTER TABLE pending_runs ADD COLUMN position bigint NOT NULL DEFAULT 0;
ALTER TABLE backfills ADD COLUMN position bigint NOT NULL DEFAULT 0;
