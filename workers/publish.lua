-- KEYS: every key the batch touches, the read ones first. ARGV[1]: the plan (JSON);
-- ARGV[2..]: the values. The plan is {"t": token, "r": retry, "tt": ttl, "m": reads,
-- "h": stats hash, "c": cancelled field, "f": reply field, "x": reply cap, "g": groups,
-- "a": commands, "k": types, "s": own, "b": shared, "n": replies an entry}.
-- The plan is flat (one table per group, and one for "a"), so that decoding it and walking
-- it cost little per request: the script's own work, not the commands it runs, was most
-- of a batch's Redis time.
-- The call sets its token key (tt seconds) at the end; a retry (plan.r) looks for it
-- first: if it exists, this very call has run before (its answer was lost), nothing runs
-- again and the first run's answer (kept in it) is returned. A call whose every command
-- is safe to repeat (no stats counts, no dead letters) has no token ("").
-- KEYS[1..m] are what the call reads, in one MGET (per thousand): every group's "done"
-- marker and cancellation marker.
-- A group is [marker, ttl, cancel, field, stream, reply, command...]: its reply and
-- commands run only if its "done" marker is absent, and then the marker is set (ttl
-- seconds), so a step that ran twice publishes (and counts its outcome) once. It counts
-- one in the field of stats hash h; if its cancellation marker cancel (0: none) exists,
-- the request was cancelled while it ran: nothing of it runs, and it counts one in field
-- c instead. Its reply (stream 0: none) is XADD stream MAXLEN ~ x * f reply: most
-- groups' one command, passed without a command's tokens. To a stream of plan.b (whose
-- gateway reads several replies an entry), the replies of groups with no command beyond
-- it are instead one entry for the call, XADD stream MAXLEN ~ x * f reply1 f1 reply2 f2
-- reply3 ..., written after the groups.
-- A run ["R", n, marker, dm, ttl, cancel, dc, field, stream, reply, dr] stands for n
-- groups with no command beyond their reply, the i-th (from 0) being [marker + i * dm,
-- ttl, cancel + i * dc, field, stream, reply + i * dr]: a batch's groups are most often
-- so, and a plan of runs is a fraction of the JSON to decode.
-- A command is n, name, its n - 1 arguments; "a" holds the commands that run once per
-- call (ack, batch stats, dead letters). In a command, a string is itself, a number
-- i >= 1 is ARGV[i + 1], -i is KEYS[i] and [i, j] is ARGV[i + 1] to ARGV[j + 1]. JOIN
-- and FAILJOIN are the join operations below; ONCE marker ttl span runs the span tokens
-- of commands after it only if a second marker is absent too, and sets it (the answer of
-- a failed branch, shared by its join's branches); any other name is a Redis command.
-- HINCRBYs are summed and sent once per field, at the end.
-- Before anything is written, plan.k (key, type, ...: the type each key a request writes
-- must have) is checked with TYPE: a key of another type (a missing one is fine) would
-- fail its command midway through the call, after earlier commands had run. If a group
-- that would run meets one, nothing runs: the answer is {0, {}, refused} where refused
-- lists marker, key, type of each such group. A key of plan.s (written by the call
-- itself: stats, dead letters, acks) is not checked but written with pcall: of another
-- type, it is not a request's fault, and every command writing it is skipped. Returns
-- {skipped, cancelled, {}, broken}: how many groups were skipped as already published,
-- the markers of those whose cancellation marker exists (cancelled), and the keys of
-- plan.s skipped for their type.
local function value(t)
  if type(t) == 'number' then
    if t < 0 then return KEYS[-t] end
    return ARGV[t + 1]
  end
  return t
end

-- A branch output arrives at a join hash; the last one enqueues the join step with every
-- branch's output as a field (prefix .. branch). A join that failed or fired stays so.
local function join(key, stream, branch, output, expected, envelope, ttl, field, prefix)
  if redis.call('HEXISTS', key, '!failed') == 1 or redis.call('HEXISTS', key, '!done') == 1 then
    return
  end
  redis.call('HSET', key, branch, output)
  redis.call('EXPIRE', key, ttl)
  local all = redis.call('HGETALL', key)
  if #all / 2 < tonumber(expected) then
    return
  end
  local fields = {field, envelope}
  for i = 1, #all, 2 do
    fields[#fields + 1] = prefix .. all[i]
    fields[#fields + 1] = all[i + 1]
  end
  redis.call('XADD', stream, '*', unpack(fields))
  redis.call('HSET', key, '!done', '1')
end

-- A failed branch stops its join from ever firing.
local function failjoin(key, ttl)
  if redis.call('HEXISTS', key, '!done') == 0 then
    redis.call('HSET', key, '!failed', '1')
    redis.call('EXPIRE', key, ttl)
  end
end

local plan = cjson.decode(ARGV[1])
local token = value(plan.t)
if plan.r and token ~= '' then  -- a retry: the first try may have run, its answer lost
  local first = redis.call('GET', token)
  if first then return cjson.decode(first) end
end

local own, wrong, muted, broken = {}, {}, {}, {}
local any_wrong = false
for _, i in ipairs(plan.s) do own[i] = true end
local types = plan.k
for j = 1, #types, 2 do
  local i, want = types[j], types[j + 1]
  local have = redis.call('TYPE', KEYS[i])['ok']
  if have ~= 'none' and have ~= want then
    wrong[i] = have
    if own[i] then
      muted[i] = true
      broken[#broken + 1] = KEYS[i]
    else
      any_wrong = true
    end
  end
end

local found = {}  -- by key number: the read keys (markers) that exist
for i = 1, plan.m, 1000 do
  local got = redis.call('MGET', unpack(KEYS, i, math.min(i + 999, plan.m)))
  for j = 1, #got do
    if got[j] then found[i + j - 1] = true end
  end
end

local counts, order = {}, {}
-- HINCRBY and HINCRBYFLOAT are summed, per key and field, and sent at the end.
local function count(kind, key, field, amount)
  local id = kind .. '\0' .. key .. '\0' .. field
  if counts[id] == nil then
    counts[id] = 0
    order[#order + 1] = {id, kind, key, field}
  end
  counts[id] = counts[id] + tonumber(amount)
end

-- A command: a key of the call's own is written with pcall (of another type: skipped,
-- named in broken); any other error stops the call as redis.call would.
local function write(args, k)
  if k and own[k] then
    local r = redis.pcall(unpack(args))
    if type(r) == 'table' and r.err then
      if string.find(r.err, 'WRONGTYPE', 1, true) then
        if not muted[k] then
          muted[k] = true
          broken[#broken + 1] = KEYS[k]
        end
        return
      end
      redis.call(unpack(args))
    end
    return
  end
  redis.call(unpack(args))
end

-- The command of tokens first..last of list.
local function command(list, first, last)
  local key = list[first + 1]
  local k = nil
  if type(key) == 'number' and key < 0 then k = -key end
  if k and muted[k] then return end
  local args = {}
  for i = first, last do
    local t = list[i]
    if type(t) == 'table' then
      for v = t[1] + 1, t[2] + 1 do args[#args + 1] = ARGV[v] end
    else
      args[#args + 1] = value(t)
    end
  end
  local name = args[1]
  if name == 'JOIN' then
    join(unpack(args, 2))
  elseif name == 'FAILJOIN' then
    failjoin(args[2], args[3])
  elseif name == 'HINCRBY' or name == 'HINCRBYFLOAT' then
    count(name, k or args[2], args[3], args[4])
  else
    write(args, k)
  end
end

-- The commands of tokens i..stop - 1 of list.
local function run(list, i, stop)
  while i < stop do
    local n = list[i]
    if list[i + 1] == 'ONCE' then
      local marker, after = value(list[i + 2]), i + 1 + n
      if redis.call('EXISTS', marker) == 0 then
        redis.call('SET', marker, '1', 'EX', list[i + 3])
        run(list, after, after + list[i + 4])
      end
      i = after + list[i + 4]
    else
      command(list, i + 1, i + n)
      i = i + 1 + n
    end
  end
end

-- Calls fn(marker, ttl, cancel, field, stream, reply, group) for each group, runs
-- unrolled (their group is nil: no commands).
local function walk(fn)
  for _, g in ipairs(plan.g) do
    if g[1] == 'R' then
      local m, dm, c, dc, r, dr = g[3], g[4], g[6], g[7], g[10], g[11]
      for i = 0, g[2] - 1 do
        fn(m + i * dm, g[5], c + i * dc, g[8], g[9], r + i * dr, nil)
      end
    else
      fn(g[1], g[2], g[3], g[4], g[5], g[6], g)
    end
  end
end

-- A key token of another type (unless muted): its key number, else nil.
local function refusing(t)
  if type(t) == 'number' and t < 0 and wrong[-t] and not muted[-t] then return -t end
  return nil
end

if any_wrong then
  local refused = {}
  walk(function(m, _, _, _, s, _, group)
    if found[-m] then return end
    local bad = refusing(s)
    if not bad and group then
      for i = 7, #group do
        bad = refusing(group[i])
        if bad then break end
      end
    end
    if bad then
      refused[#refused + 1] = KEYS[-m]
      refused[#refused + 1] = KEYS[bad]
      refused[#refused + 1] = wrong[bad]
    end
  end)
  if #refused > 0 then return {0, {}, refused, broken} end
end
local skipped, cancelled = 0, {}
local tally, fields = {}, {}  -- outcomes counted, by field; their fields in order
local batched, streams = {}, {}  -- replies written per stream at the end; those streams
local shared = {}  -- the streams of plan.b
for _, s in ipairs(plan.b) do shared[s] = true end
walk(function(m, ttl, cancel, field, s, reply, group)
  m = -m
  if found[m] then
    skipped = skipped + 1
    return
  end
  redis.call('SET', KEYS[m], '1', 'EX', ttl)
  if cancel ~= 0 and found[-cancel] then
    cancelled[#cancelled + 1] = KEYS[m]
    field = plan.c
  else
    if s ~= 0 and not muted[-s] then
      local value = ARGV[reply + 1]
      if not shared[s] or (group and #group > 6) then  -- (its commands come after it)
        redis.call('XADD', KEYS[-s], 'MAXLEN', '~', plan.x, '*', plan.f, value)
      else
        local out = batched[s]
        if out == nil then
          out = {}
          batched[s] = out
          streams[#streams + 1] = s
        end
        out[#out + 1] = value
      end
    end
    if group then run(group, 7, #group + 1) end
  end
  if tally[field] == nil then
    tally[field] = 0
    fields[#fields + 1] = field
  end
  tally[field] = tally[field] + 1
end)
-- An entry holds at most plan.n replies (unpack takes a few thousand values at most, and
-- a reader takes no more): f, then f1, f2, ... name them in order. The cap x counts
-- entries, as for one reply: an entry of a batch's replies is never trimmed sooner than
-- one reply's would be.
local ENTRY = plan.n
for _, s in ipairs(streams) do
  local values = batched[s]
  for first = 1, #values, ENTRY do
    local last = math.min(first + ENTRY - 1, #values)
    local args = {'XADD', KEYS[-s], 'MAXLEN', '~', plan.x, '*', plan.f, values[first]}
    for i = first + 1, last do
      args[#args + 1] = plan.f .. (i - first)
      args[#args + 1] = values[i]
    end
    redis.call(unpack(args))
  end
end
for _, field in ipairs(fields) do count('HINCRBY', plan.h, field, tally[field]) end
run(plan.a, 1, #plan.a + 1)
for _, c in ipairs(order) do
  local id, kind, key, field = c[1], c[2], c[3], c[4]
  local amount = counts[id]
  if kind == 'HINCRBY' then amount = string.format('%d', amount) end
  local k = nil
  if type(key) == 'number' then
    k = key
    key = KEYS[k]
  end
  if not (k and muted[k]) then write({kind, key, field, amount}, k) end
end
local answer = {skipped, cancelled, {}, broken}
if token ~= '' then redis.call('SET', token, cjson.encode(answer), 'EX', plan.tt) end
return answer
