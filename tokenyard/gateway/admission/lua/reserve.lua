-- Check and reserve units in several GCRA buckets at once, atomically, on the server's clock: the
-- tenant's request and token buckets and, for a key with limits of its own, the key's. Every bucket
-- must allow, or none is charged.
--
-- GCRA (generic cell rate algorithm) per bucket: the state is one number, the theoretical arrival
-- time (TAT, microseconds). With `limit` units per `window` microseconds, each unit moves the
-- TAT `window / limit` later; a reservation is allowed when the TAT it would leave is at most
-- one window ahead of now, so the burst is one window's worth and over any interval t no more
-- than burst + limit * t / window units are ever granted. A limit of 0 means unlimited.
--
-- KEYS[i] bucket i (all with one hash tag: the tenant)
-- ARGV[3i-2], ARGV[3i-1], ARGV[3i]: bucket i's limit, window_us, cost
-- Returns {allowed, now_us, too_large, then for each bucket: retry_us, remaining, reset_us};
-- remaining -1 for an unlimited bucket.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

local function check(key, limit, window, cost)
  if limit <= 0 then return 1, nil, 0, -1, 0, 0 end
  if cost > limit then return 0, nil, 0, limit, 0, 1 end   -- can never fit: too large
  local interval = window / limit
  local tat = tonumber(redis.call('GET', key) or '0')
  if tat < now then tat = now end
  local new_tat = tat + cost * interval
  local allow_at = new_tat - window
  if allow_at > now then
    return 0, nil, math.ceil(allow_at - now), math.floor((window - (tat - now)) / interval), math.ceil(tat - now), 0
  end
  return 1, math.ceil(new_tat), 0, math.floor((window - (new_tat - now)) / interval), math.ceil(new_tat - now), 0
end

local allowed, too_large = 1, 0
local tats, out = {}, {}
for i = 1, #KEYS do
  local ok, tat, retry, rem, reset, big = check(KEYS[i], tonumber(ARGV[3 * i - 2]), tonumber(ARGV[3 * i - 1]),
                                               tonumber(ARGV[3 * i]))
  if ok ~= 1 then allowed = 0 end
  if big == 1 then too_large = 1 end
  tats[i] = tat
  out[#out + 1] = retry
  out[#out + 1] = rem
  out[#out + 1] = reset
end
if allowed == 1 then
  -- The key outlives its TAT by a second; after that the bucket is full and may as well not exist.
  for i = 1, #KEYS do
    if tats[i] then
      redis.call('SET', KEYS[i], string.format('%d', tats[i]), 'PX', math.ceil((tats[i] - now) / 1000) + 1000)
    end
  end
end
local res = {allowed, now, too_large}
for i = 1, #out do res[#res + 1] = out[i] end
return res
