-- Record one request's usage exactly once, with its hourly rollup, in one atomic step.
-- KEYS[1] seen key  KEYS[2] stream  KEYS[3] rollup hash (tenant x hour)  KEYS[4] hours index  KEYS[5] tenants set
-- ARGV[1] record JSON  ARGV[2] engine  ARGV[3] hour  ARGV[4] tenant
-- ARGV[5..10] prompt, cached, completion, cost_micros, baseline_cost_micros, errors (0/1)
-- ARGV[11] rollup TTL s  ARGV[12] seen TTL s  ARGV[13] stream MAXLEN  ARGV[14] stream MINID (ms; 0: none)
-- ARGV[15] oldest hour kept in the hours index (older members point at expired rollups)
-- Returns 1 when recorded, 0 when the request id was already recorded (a replay).
-- Counts go to HINCRBY as the strings they arrived as: Lua numbers are doubles, Redis integers are
-- 64-bit, so no arithmetic happens here and sums stay exact.
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[12]) then
  return 0
end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[13], '*', 'r', ARGV[1])
if ARGV[14] ~= '0' then
  redis.call('XTRIM', KEYS[2], 'MINID', '~', ARGV[14])
end
local m = ARGV[2] .. '|'
redis.call('HINCRBY', KEYS[3], m .. 'requests', 1)
redis.call('HINCRBY', KEYS[3], m .. 'prompt_tokens', ARGV[5])
redis.call('HINCRBY', KEYS[3], m .. 'cached_tokens', ARGV[6])
redis.call('HINCRBY', KEYS[3], m .. 'completion_tokens', ARGV[7])
redis.call('HINCRBY', KEYS[3], m .. 'cost_micros', ARGV[8])
redis.call('HINCRBY', KEYS[3], m .. 'baseline_cost_micros', ARGV[9])
redis.call('HINCRBY', KEYS[3], m .. 'errors', ARGV[10])
redis.call('EXPIRE', KEYS[3], ARGV[11])
redis.call('ZADD', KEYS[4], ARGV[3], ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', '(' .. ARGV[15])
redis.call('EXPIRE', KEYS[4], ARGV[11])
redis.call('EXPIRE', KEYS[2], ARGV[11])
redis.call('SADD', KEYS[5], ARGV[4])
return 1
