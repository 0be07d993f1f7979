-- Answer one line of a batch at most once: the answer and its count in one atomic step, so a
-- restart (or a second gateway) can never count or write a line twice.
-- KEYS[1] results hash (line index -> "o" or "e" + the output or error file's line)  KEYS[2] batch hash
-- ARGV[1] line index  ARGV[2] "o" (completed: output file) or "e" (failed: error file)  ARGV[3] the line
-- Returns 1 when recorded now, 0 when the line had an answer already.
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2] .. ARGV[3]) == 0 then
  return 0
end
redis.call('HINCRBY', KEYS[2], ARGV[2] == 'o' and 'completed' or 'failed', 1)
return 1
