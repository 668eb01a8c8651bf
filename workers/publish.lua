-- KEYS: every key the batch touches. ARGV[1]: the plan (JSON); ARGV[2..]: the values.
-- The plan is {"t": token, "tt": ttl, "g": groups, "a": commands, "k": types, "s": own}.
-- The call sets its token key (tt seconds) at the end; a retry (plan.r) looks for it
-- first: if it exists, this very call has run before (its answer was lost), nothing runs
-- again and the first run's answer (kept in it) is returned. A call whose every command
-- is safe to repeat (no stats counts, no dead letters) has no token (""). A group is [marker, ttl, command...]: its commands run only if
-- its "done" marker is absent, and then the marker is set (ttl seconds), so a step that
-- ran twice publishes (and counts its outcome) once. "a" runs once per call (ack, batch
-- stats, dead letters). In a command, a string is itself, a number n >= 1 is ARGV[n + 1]
-- and -n is KEYS[n]. JOIN and FAILJOIN are the join operations below; ONCE marker ttl
-- command... runs its commands only if a second marker is absent too, and sets it (the
-- answer of a failed branch, shared by its join's branches); UNLESS key otherwise
-- command... runs its commands only if key is absent, else the one command otherwise (a
-- request cancelled while it ran: its count alone); any other name is a Redis command.
-- Reads are made once per call: every group's marker and UNLESS key in one MGET;
-- HINCRBYs are summed and sent once per field, at the end.
-- Before anything is written, plan.k (the type each key a request writes must have:
-- 'stream', 'hash', '' for any) is checked with TYPE: a key of another type (a missing
-- one is fine) would fail its command midway through the call, after earlier commands
-- had run. If a group that would run meets one, nothing runs: the answer is
-- {0, {}, refused} where refused lists marker, key, type of each such group. A key of
-- plan.s (written by the call itself: stats, dead letters, acks) is not checked but
-- written with pcall: of another type, it is not a request's fault, and every command
-- writing it is skipped. Returns {skipped, cancelled, {}, broken}: how many groups were
-- skipped as already published, the markers of those whose UNLESS found its key
-- (cancelled), and the keys of plan.s skipped for their type.
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
for _, i in ipairs(plan.s) do own[i] = true end
for i, want in ipairs(plan.k) do
  if want ~= '' then
    local have = redis.call('TYPE', KEYS[i])['ok']
    if have ~= 'none' and have ~= want then
      wrong[i] = have
      if own[i] then
        muted[i] = true
        broken[#broken + 1] = KEYS[i]
      end
    end
  end
end

-- Which of the keys names (a list) exist: one MGET per thousand.
local function present(names)
  local found = {}
  for i = 1, #names, 1000 do
    local got = redis.call('MGET', unpack(names, i, math.min(i + 999, #names)))
    for j = 1, #got do
      if got[j] then found[names[i + j - 1]] = true end
    end
  end
  return found
end

local markers, names = {}, {}
for j, group in ipairs(plan.g) do
  markers[j] = value(group[1])
  names[#names + 1] = markers[j]
  local c = group[3]
  if type(c) == 'table' and c[1] == 'UNLESS' then names[#names + 1] = value(c[2]) end
end
local found = present(names)  -- "done" markers and cancellation markers alike

-- The first key of a wrong type that a command (or a group) would write, or nil.
local function culprit(command)
  for i = 1, #command do
    local t = command[i]
    if type(t) == 'table' then
      local n = culprit(t)
      if n then return n end
    elseif type(t) == 'number' and t < 0 and wrong[-t] and not muted[-t] then
      return -t
    end
  end
  return nil
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

local function run(command)
  if command[1] == 'UNLESS' then
    if found[value(command[2])] then
      run(command[3])
      return true
    end
    for i = 4, #command do run(command[i]) end
    return false
  end
  if command[1] == 'ONCE' then
    local marker = value(command[2])
    if redis.call('EXISTS', marker) == 0 then
      redis.call('SET', marker, '1', 'EX', command[3])
      for i = 4, #command do run(command[i]) end
    end
    return
  end
  local k = nil
  if type(command[2]) == 'number' and command[2] < 0 then k = -command[2] end
  if k and muted[k] then return end
  local args = {}
  for i = 1, #command do args[i] = value(command[i]) end
  if args[1] == 'JOIN' then
    join(unpack(args, 2))
  elseif args[1] == 'FAILJOIN' then
    failjoin(args[2], args[3])
  elseif args[1] == 'HINCRBY' or args[1] == 'HINCRBYFLOAT' then
    count(args[1], k or args[2], args[3], args[4])
  else
    write(args, k)
  end
end

local refused = {}
for j, group in ipairs(plan.g) do
  if not found[markers[j]] then
    local n = culprit(group)
    if n then
      refused[#refused + 1] = markers[j]
      refused[#refused + 1] = KEYS[n]
      refused[#refused + 1] = wrong[n]
    end
  end
end
if #refused > 0 then return {0, {}, refused, broken} end
local skipped, cancelled = 0, {}
for j, group in ipairs(plan.g) do
  local marker = markers[j]
  if found[marker] then
    skipped = skipped + 1
  else
    redis.call('SET', marker, '1', 'EX', group[2])
    for i = 3, #group do
      if run(group[i]) then cancelled[#cancelled + 1] = marker end
    end
  end
end
for _, command in ipairs(plan.a) do run(command) end
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
