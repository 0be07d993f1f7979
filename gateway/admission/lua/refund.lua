-- Give back part of a reservation (tokens a request did not use; a request that never ran):
-- move each bucket's TAT earlier by the units returned. A TAT at or before now means a full
-- bucket, so the key is deleted; the refund can never raise a bucket above its burst.
--
-- KEYS[1] request bucket, KEYS[2] token bucket
-- ARGV: request_limit, token_limit, window_us, requests, tokens
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local window = tonumber(ARGV[3])

local function refund(key, limit, units)
  if limit <= 0 or units <= 0 then return end
  local tat = tonumber(redis.call('GET', key) or '0')
  if tat <= now then return end
  tat = math.ceil(tat - units * window / limit)
  if tat <= now then
    redis.call('DEL', key)
  else
    redis.call('SET', key, string.format('%d', tat), 'PX', math.ceil((tat - now) / 1000) + 1000)
  end
end

refund(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[4]))
refund(KEYS[2], tonumber(ARGV[2]), tonumber(ARGV[5]))
return 1
