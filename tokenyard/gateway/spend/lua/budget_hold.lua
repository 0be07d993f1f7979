-- Reserve a request's worst-case cost against its budgets, atomically, on the server's clock.
-- Each budget period is a meter: the micro-units settled (actual costs) plus those held by
-- requests in flight (worst cases). A hold is a member "id:amount" of the meter's `held` sorted
-- set, scored by the time it expires: a gateway that dies before settling a hold gives it back
-- when it expires (the next reservation on that meter subtracts it).
--
-- The rule is the budget's: a meter at or over its limit is reached. A request is admitted when no
-- checked meter is reached, then holds its worst case in every meter, so the spend can pass a
-- limit by at most one request's cost (the one admitted just under it).
--
-- KEYS[2i-1] meter i (an integer), KEYS[2i] its held set (all with one hash tag: the tenant)
-- ARGV[1] hold id, ARGV[2] amount (micro-units), ARGV[3] hold lifetime (us)
-- ARGV[4i..4i+3] meter i: limit, seed (the spend the rollups show: a meter is never below it),
--                check (1: refuse at the limit; 0: count only), expire_at (unix s, after the period)
-- Returns {admitted, index of the reached meter or 0, each meter's value before this request}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local amount = tonumber(ARGV[2])
local n = #KEYS / 2
local values, reached = {}, 0
for i = 1, n do
  local meter, held = KEYS[2 * i - 1], KEYS[2 * i]
  local v = tonumber(redis.call('GET', meter) or '0')
  local expired = redis.call('ZRANGEBYSCORE', held, '-inf', now)
  if #expired > 0 then
    for _, m in ipairs(expired) do
      v = v - tonumber(string.match(m, ':(%d+)$'))
    end
    redis.call('ZREMRANGEBYSCORE', held, '-inf', now)
  end
  local seed = tonumber(ARGV[4 * i + 1])
  if v < seed then v = seed end
  values[i] = v
  if reached == 0 and tonumber(ARGV[4 * i + 2]) == 1 and v >= tonumber(ARGV[4 * i]) then reached = i end
end
local admitted = 0
if reached == 0 then admitted = 1 end
local member = ARGV[1] .. ':' .. ARGV[2]
for i = 1, n do
  local meter, held, expire_at = KEYS[2 * i - 1], KEYS[2 * i], tonumber(ARGV[4 * i + 3])
  local v = values[i]
  if admitted == 1 then
    v = v + amount
    redis.call('ZADD', held, now + tonumber(ARGV[3]), member)
    redis.call('EXPIREAT', held, expire_at)
  end
  redis.call('SET', meter, string.format('%d', v), 'EXAT', expire_at)
end
local out = {admitted, reached}
for i = 1, n do out[#out + 1] = values[i] end
return out
