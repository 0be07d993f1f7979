-- Make a new policy version current, atomically, only if the current one is still the expected one
-- (two admins applying at once: one wins, the other re-reads and retries), then announce it.
-- KEYS[1] {prefix}policy:current   KEYS[2] {prefix}policy:versions (hash: version -> record JSON)
-- ARGV[1] expected current version ('0': none yet)  ARGV[2] new version  ARGV[3] record JSON
-- ARGV[4] pub/sub channel ({prefix}policy:events)
-- Returns {1, new} when applied, {0, current} when the current version moved on (retry).
local cur = redis.call('GET', KEYS[1]) or '0'
if cur ~= ARGV[1] or redis.call('HEXISTS', KEYS[2], ARGV[2]) == 1 then
  return {0, cur}
end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
redis.call('SET', KEYS[1], ARGV[2])
redis.call('PUBLISH', ARGV[4], 'version ' .. ARGV[2])
return {1, ARGV[2]}
