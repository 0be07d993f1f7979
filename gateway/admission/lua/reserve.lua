-- Check and reserve one request and N tokens for a tenant, atomically, on the server's clock.
-- GCRA (generic cell rate algorithm) per limit: the state is one number, the theoretical arrival
-- time (TAT, microseconds). With `limit` units per `window` microseconds, each unit moves the
-- TAT `window / limit` later; a reservation is allowed when the TAT it would leave is at most
-- one window ahead of now, so the burst is one window's worth and over any interval t no more
-- than burst + limit * t / window units are ever granted. Both limits must allow, or neither is
-- charged. A limit of 0 means unlimited.
--
-- KEYS[1] request bucket, KEYS[2] token bucket (one hash tag: the tenant)
-- ARGV: request_limit, token_limit, window_us, requests, tokens
-- Returns {allowed, now_us, too_large, req_retry_us, tok_retry_us, req_remaining, tok_remaining,
--          req_reset_us, tok_reset_us}; remaining -1 for an unlimited bucket.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local window = tonumber(ARGV[3])

local function check(key, limit, cost)
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

local ra, rtat, rretry, rrem, rreset, rbig = check(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[4]))
local ta, ttat, tretry, trem, treset, tbig = check(KEYS[2], tonumber(ARGV[2]), tonumber(ARGV[5]))
local allowed = 0
if ra == 1 and ta == 1 then
  allowed = 1
  -- The key outlives its TAT by a second; after that the bucket is full and may as well not exist.
  if rtat then redis.call('SET', KEYS[1], string.format('%d', rtat), 'PX', math.ceil((rtat - now) / 1000) + 1000) end
  if ttat then redis.call('SET', KEYS[2], string.format('%d', ttat), 'PX', math.ceil((ttat - now) / 1000) + 1000) end
end
local too_large = 0
if rbig == 1 or tbig == 1 then too_large = 1 end
return {allowed, now, too_large, rretry, tretry, rrem, trem, rreset, treset}
