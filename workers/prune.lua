-- Remove a gone worker's consumer from a stage stream's group, only while it holds nothing
-- pending there: XGROUP DELCONSUMER drops a consumer's pending entries with it, and they
-- would then never be reclaimed. One call, so nothing is delivered to it in between.
-- KEYS[1]: the stream; ARGV[1]: the group; ARGV[2]: the consumer.
-- Returns 1: removed (or another worker removed it first); 0: kept, it holds pending entries.
local held = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2])
if #held > 0 then
    return 0
end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
return 1
