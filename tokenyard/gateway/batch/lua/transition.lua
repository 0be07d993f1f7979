-- Move a batch to a new status if it is in one of the allowed ones (compare and set).
-- KEYS[1] batch hash  KEYS[2] set of unfinished batch ids  KEYS[3] results hash
-- KEYS[4] (optional, final moves) the input file's users set: the batch leaves it (the file is free
-- to delete once no open batch is in it)
-- ARGV[1] batch id  ARGV[2] new status  ARGV[3] timestamp field to set ("" for none)  ARGV[4] now (s)
-- ARGV[5] "1" when the new status is final (the id leaves the unfinished set, the results go)
-- ARGV[6..] the statuses it may move from
-- Returns 1 when moved, 0 when the batch was in another status (or is gone).
local current = redis.call('HGET', KEYS[1], 'status')
if not current then
  return 0
end
for i = 6, #ARGV do
  if current == ARGV[i] then
    redis.call('HSET', KEYS[1], 'status', ARGV[2])
    if ARGV[3] ~= '' then
      redis.call('HSET', KEYS[1], ARGV[3], ARGV[4])
    end
    if ARGV[5] == '1' then
      redis.call('SREM', KEYS[2], ARGV[1])
      redis.call('DEL', KEYS[3])
      if KEYS[4] then
        redis.call('SREM', KEYS[4], ARGV[1])
      end
    end
    return 1
  end
end
return 0
