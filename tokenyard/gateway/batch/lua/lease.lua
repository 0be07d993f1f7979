-- Claim or renew a gateway's lease on running a batch: free, or already this gateway's.
-- KEYS[1] lease key  ARGV[1] this gateway's id  ARGV[2] lease length in ms  ARGV[3] "1" claim/renew, "0" release
-- Returns 1 when this gateway holds (or released) the lease, 0 when another gateway holds it.
local owner = redis.call('GET', KEYS[1])
if owner and owner ~= ARGV[1] then
  return 0
end
if ARGV[3] == '1' then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
elseif owner then
  redis.call('DEL', KEYS[1])
end
return 1
