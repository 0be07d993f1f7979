-- Settle a hold with the request's actual cost: each meter gets actual - held (the unused part of
-- the worst case comes back). A hold that already expired was given back then, so its meter gets
-- the whole actual cost. A meter whose period is over (key gone) is left alone.
--
-- KEYS[2i-1] meter i, KEYS[2i] its held set
-- ARGV[1] hold member ("id:amount"), ARGV[2] amount held, ARGV[3] actual cost (micro-units)
local held_amount, actual = tonumber(ARGV[2]), tonumber(ARGV[3])
for i = 1, #KEYS / 2 do
  local meter, held = KEYS[2 * i - 1], KEYS[2 * i]
  if redis.call('EXISTS', meter) == 1 then
    local delta = actual
    if redis.call('ZREM', held, ARGV[1]) == 1 then delta = actual - held_amount end
    if delta ~= 0 then redis.call('INCRBY', meter, delta) end
  end
end
return 1
