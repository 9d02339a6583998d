--[[
  advance: the position of a shard of the index (invariant 9). A position counts the
  transactions of PostgreSQL that changed a schedule of the shard; `pos` is the last one whose
  writes this index holds, all earlier ones included. Writes land out of order (two group
  commits write concurrently), so a position past a gap waits in `ahead` until the gap closes.
  Called after the writes of a position (same slot: a replica that has this call has them).

  KEYS[1] pos    STRING the last position applied with every earlier one
  KEYS[2] ahead  ZSET   positions applied past a gap (member and score: the position)
  ARGV[1] mode   'note'  : ARGV[2] was applied (the intake, after its index writes)
                 'floor' : every position up to ARGV[2] is applied (the sweeper, after
                           replaying the rows PostgreSQL had committed up to it)
                 'start' : as 'floor', only when the shard has no position yet (a rebuild of
                           an empty index, from a read of PostgreSQL after ARGV[2])
  ARGV[2] position

  Returns the shard's position after the call.
]]
--!include lib/position.lua

return position_advance(KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2]))
