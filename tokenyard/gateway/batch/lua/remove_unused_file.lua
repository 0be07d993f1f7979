-- Remove a file's record unless an open batch reads it (its users set is not empty), atomically, so a
-- batch being created on the file at the same moment either finds no file or keeps it.
-- KEYS[1] file hash  KEYS[2] the tenant's file index  KEYS[3] users set  ARGV[1] file id
-- Returns 1 when removed (or already gone), 0 when in use.
if redis.call('SCARD', KEYS[3]) > 0 then
  return 0
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
