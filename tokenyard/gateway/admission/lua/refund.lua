-- Give back part of a reservation (tokens a request did not use; a request that never ran):
-- move each bucket's TAT earlier by the units returned. A TAT at or before now means a full
-- bucket, so the key is deleted; the refund can never raise a bucket above its burst.
--
-- KEYS[i] bucket i
-- ARGV[3i-2], ARGV[3i-1], ARGV[3i]: bucket i's limit, window_us, units returned
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

local function refund(key, limit, window, units)
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

for i = 1, #KEYS do
  refund(KEYS[i], tonumber(ARGV[3 * i - 2]), tonumber(ARGV[3 * i - 1]), tonumber(ARGV[3 * i]))
end
return 1
