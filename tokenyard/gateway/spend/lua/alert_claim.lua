-- Claim the webhook outbox items that are due, with a lease: each claimed item's due time moves to
-- the end of the lease, so no other sender (another gateway, a restarted one) takes it meanwhile.
-- KEYS[1] due zset (id -> ms)  KEYS[2] outbox hash (id -> JSON)  KEYS[3] attempts hash (id -> count)
-- ARGV[1] now ms  ARGV[2] lease end ms  ARGV[3] most items to claim
-- Returns a flat list: id, JSON, attempt number (1 for the first try), ...
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
local out = {}
for _, id in ipairs(ids) do
  local body = redis.call('HGET', KEYS[2], id)
  if body then
    redis.call('ZADD', KEYS[1], ARGV[2], id)
    out[#out + 1] = id
    out[#out + 1] = body
    out[#out + 1] = redis.call('HINCRBY', KEYS[3], id, 1)
  else
    redis.call('ZREM', KEYS[1], id)
  end
end
return out
