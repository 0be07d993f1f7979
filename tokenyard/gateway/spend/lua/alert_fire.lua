-- Fire one budget alert at most once: the fired marker, the alerts stream entry and the webhook
-- outbox item in one atomic step (all or nothing, so a crash can never leave a marker without its alert).
-- KEYS[1] fired marker  KEYS[2] alerts stream  KEYS[3] outbox hash (id -> JSON)  KEYS[4] due zset (id -> ms)
-- ARGV[1] alert JSON  ARGV[2] alert id  ARGV[3] marker TTL s  ARGV[4] stream MAXLEN  ARGV[5] due ms
-- ARGV[6] "1": queue for the webhook, "0": stream only
-- Returns 1 when fired now, 0 when it had fired before (by this or another gateway).
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[3]) then
  return 0
end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'a', ARGV[1])
if ARGV[6] == '1' then
  redis.call('HSET', KEYS[3], ARGV[2], ARGV[1])
  redis.call('ZADD', KEYS[4], ARGV[5], ARGV[2])
end
return 1
