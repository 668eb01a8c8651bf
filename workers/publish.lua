-- KEYS: every key the batch touches. ARGV[1]: the plan (JSON); ARGV[2..]: the values.
-- The plan is {"t": token, "tt": ttl, "g": groups, "a": commands}. If the token key
-- exists, this very call has run before (its answer was lost): nothing runs again and
-- the first run's answer (kept in it) is returned; else it is set (tt seconds) at the
-- end. A group is [marker, ttl, command...]: its commands run only if its "done" marker
-- is absent, and then the marker is set (ttl seconds), so a step that ran twice
-- publishes (and counts its outcome) once. "a" runs once per call (ack, batch stats, dead letters).
-- In a command, a string is itself, a number n >= 1 is ARGV[n + 1] and -n is KEYS[n].
-- JOIN and FAILJOIN are the join operations below; ONCE marker ttl command... runs its
-- commands only if a second marker is absent too, and sets it (the answer of a failed
-- branch, shared by its join's branches); UNLESS key otherwise command... runs its
-- commands only if key is absent, else the one command otherwise (a request cancelled
-- while it ran: its count alone); any other name is a Redis command.
-- Before anything is written, plan.k (each key's type: 'stream', 'hash', '' for any)
-- is checked: a key of another type (a missing one is fine) would fail its command midway
-- through the call, after earlier commands had run. If a group that would run meets one,
-- nothing runs: the answer is {0, {}, refused} where refused lists marker, key, type of
-- each such group. A key of plan.s (written by the call itself, "a": stats, dead letters,
-- acks) of another type is not a request's fault: every command writing it is skipped.
-- Returns {skipped, cancelled, {}, broken}: how many groups were skipped as already
-- published, the markers of those whose UNLESS found its key (cancelled), and the keys
-- of plan.s skipped for their type.
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
local wrong, muted, broken = {}, {}, {}
for i, want in ipairs(plan.k) do
  if want ~= '' then
    local have = redis.call('TYPE', KEYS[i])['ok']
    if have ~= 'none' and have ~= want then wrong[i] = have end
  end
end
for _, i in ipairs(plan.s) do
  if wrong[i] then
    muted[i] = true
    broken[#broken + 1] = KEYS[i]
  end
end

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

local function run(command)
  if command[1] == 'UNLESS' then
    if redis.call('EXISTS', value(command[2])) == 1 then
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
  if type(command[2]) == 'number' and command[2] < 0 and muted[-command[2]] then
    return
  end
  local args = {}
  for i = 1, #command do args[i] = value(command[i]) end
  if args[1] == 'JOIN' then
    join(unpack(args, 2))
  elseif args[1] == 'FAILJOIN' then
    failjoin(args[2], args[3])
  else
    redis.call(unpack(args))
  end
end

local token = value(plan.t)
local first = redis.call('GET', token)
if first then return cjson.decode(first) end
local refused = {}
for _, group in ipairs(plan.g) do
  if redis.call('EXISTS', value(group[1])) == 0 then
    local n = culprit(group)
    if n then
      refused[#refused + 1] = value(group[1])
      refused[#refused + 1] = KEYS[n]
      refused[#refused + 1] = wrong[n]
    end
  end
end
if #refused > 0 then return {0, {}, refused, broken} end
local skipped, cancelled = 0, {}
for _, group in ipairs(plan.g) do
  local marker = value(group[1])
  if redis.call('EXISTS', marker) == 1 then
    skipped = skipped + 1
  else
    redis.call('SET', marker, '1', 'EX', group[2])
    for i = 3, #group do
      if run(group[i]) then cancelled[#cancelled + 1] = marker end
    end
  end
end
for _, command in ipairs(plan.a) do run(command) end
local answer = {skipped, cancelled, {}, broken}
redis.call('SET', token, cjson.encode(answer), 'EX', plan.tt)
return answer
