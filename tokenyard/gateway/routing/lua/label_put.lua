-- One feedback label, stored atomically (tokenyard/gateway/routing/feedback_store.py).
-- KEYS[1] labels hash (response id -> label JSON), KEYS[2] order zset (response id by write time),
-- KEYS[3] the tenants set.
-- ARGV: response id, label JSON, now (unix s), cutoff (older labels expire), max labels, key TTL (s), tenant.
-- Returns 1 when the id was new, 0 when its label was replaced (a repeated feedback is one label).
local labels, order = KEYS[1], KEYS[2]
local id, data, now, cutoff = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local max, ttl = tonumber(ARGV[5]), tonumber(ARGV[6])
local old = redis.call('ZRANGEBYSCORE', order, '-inf', '(' .. cutoff)
for _, gone in ipairs(old) do
  redis.call('HDEL', labels, gone)
  redis.call('ZREM', order, gone)
end
local new = redis.call('HSET', labels, id, data)
redis.call('ZADD', order, now, id)
while redis.call('ZCARD', order) > max do
  local popped = redis.call('ZPOPMIN', order)
  redis.call('HDEL', labels, popped[1])
end
redis.call('EXPIRE', labels, ttl)
redis.call('EXPIRE', order, ttl)
redis.call('SADD', KEYS[3], ARGV[7])
return new
