-- Record one request's usage exactly once, with its hourly rollup, in one atomic step.
-- KEYS[1] seen key  KEYS[2] stream  KEYS[3] rollup hash (tenant x hour)  KEYS[4] hours index  KEYS[5] tenants set
-- ARGV[1] record JSON without its tags (the stream entry's 'r'; its kept tags go in 't', see below)  ARGV[2] engine  ARGV[3] hour  ARGV[4] tenant
-- ARGV[5..10] prompt, cached, completion, cost_micros, baseline_cost_micros, errors (0/1)
-- ARGV[11] rollup TTL s  ARGV[12] seen TTL s  ARGV[13] stream MAXLEN  ARGV[14] stream MINID (ms; 0: none)
-- ARGV[15] oldest hour kept in the hours index (older members point at expired rollups)
-- KEYS[6] dimension rollup hash (tenant x hour)  KEYS[7] the tag names kept (tenant x hour)
-- KEYS[8..7+D] one value set per dimension  KEYS[8+D] the stream-id sequence (one for every tenant)
-- ARGV[16] D, the record's dimensions (key, user, route, adapter, tag:NAME with a value)  ARGV[17] values kept per dimension
-- ARGV[18] tag names kept per tenant and hour  ARGV[19] the folded dimension ("tag:(other)")
-- ARGV[20] the field prefix of the folded dimension's one value ("(other)") on this engine
-- ARGV[21..] per dimension: its value, the field prefix for it, the field prefix for "(other)", and
--   its name when it is a tag (subject to the tag-name bound), else ""
-- Returns 1 when recorded, 0 when the request id was already recorded (a replay).
-- Counts go to HINCRBY as the strings they arrived as: Lua numbers are doubles, Redis integers are
-- 64-bit, so no arithmetic happens here and sums stay exact.
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[12]) then
  return 0
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
redis.call('SADD', KEYS[5], ARGV[4])
-- The same counters by each dimension of the record. A dimension holds at most ARGV[17] distinct
-- values per tenant and hour; past that, new values are counted under "(other)". Tag names are
-- bounded too: at most ARGV[18] distinct tag names per tenant and hour get a dimension of their
-- own; the record's other tags are counted once, together, under the folded dimension ARGV[19]
-- (value "(other)"). So neither many values nor many names can grow the rollup without bound, and
-- every dimension's sums still equal the records' (reports: top values plus "(other)").
local function count(prefix)
  redis.call('HINCRBY', KEYS[6], prefix .. 'requests', 1)
  redis.call('HINCRBY', KEYS[6], prefix .. 'prompt_tokens', ARGV[5])
  redis.call('HINCRBY', KEYS[6], prefix .. 'cached_tokens', ARGV[6])
  redis.call('HINCRBY', KEYS[6], prefix .. 'completion_tokens', ARGV[7])
  redis.call('HINCRBY', KEYS[6], prefix .. 'cost_micros', ARGV[8])
  redis.call('HINCRBY', KEYS[6], prefix .. 'baseline_cost_micros', ARGV[9])
  redis.call('HINCRBY', KEYS[6], prefix .. 'errors', ARGV[10])
end
local dims = tonumber(ARGV[16])
local folded = false
-- The request stream keeps the same tags the rollups do: those whose name is kept, with their
-- values as sent ('t', a JSON object), and the number of tags folded into "(other)" ('x'). So
-- hostile tag names grow neither the rollups nor the per-request log (issue 46.4).
local kept_tags = {}
local nfolded = 0
for d = 1, dims do
  local base = 21 + (d - 1) * 4
  local set = KEYS[7 + d]
  local prefix = ARGV[base + 1]
  local tag = ARGV[base + 3]
  local kept = true
  if tag ~= '' then
    if tag == ARGV[19] then
      kept = false        -- a tag literally named "(other)" is the folded dimension's, never its own
    elseif redis.call('SISMEMBER', KEYS[7], tag) == 0 then
      if redis.call('SCARD', KEYS[7]) >= tonumber(ARGV[18]) then
        kept = false
      else
        redis.call('SADD', KEYS[7], tag)
        redis.call('EXPIRE', KEYS[7], ARGV[11])
      end
    end
    folded = folded or not kept
    if kept then
      kept_tags[string.sub(tag, 5)] = ARGV[base]
    else
      nfolded = nfolded + 1
    end
  end
  if kept then
    if redis.call('SISMEMBER', set, ARGV[base]) == 0 then
      if redis.call('SCARD', set) >= tonumber(ARGV[17]) then
        prefix = ARGV[base + 2]
      else
        redis.call('SADD', set, ARGV[base])
        redis.call('EXPIRE', set, ARGV[11])
      end
    end
    count(prefix)
  end
end
if folded then
  count(ARGV[20])
end
local entry = {'r', ARGV[1]}
if next(kept_tags) ~= nil then
  entry[#entry + 1] = 't'
  entry[#entry + 1] = cjson.encode(kept_tags)
end
if nfolded > 0 then
  entry[#entry + 1] = 'x'
  entry[#entry + 1] = tostring(nfolded)
end
-- The entry's id: this server's time in ms (never below the stream's newest entry's) and a sequence
-- shared by every tenant's stream. Redis's own ids ('*') number entries per stream, so entries of two
-- tenants recorded in the same millisecond (the ledger writes a batch in one round trip) could not be
-- ordered against each other; these are ordered as recorded, across tenants (store.records merges by id).
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local newest = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)[1]
if newest then
  local newest_ms = tonumber(string.match(newest[1], '^(%d+)-'))
  if newest_ms > ms then
    ms = newest_ms
  end
end
local id = string.format('%.0f', ms) .. '-' .. redis.call('INCR', KEYS[8 + dims])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[13], id, unpack(entry))
if ARGV[14] ~= '0' then
  redis.call('XTRIM', KEYS[2], 'MINID', '~', ARGV[14])
end
redis.call('EXPIRE', KEYS[2], ARGV[11])
if dims > 0 then
  redis.call('EXPIRE', KEYS[6], ARGV[11])
end
return 1
