"""The floor every package stands on: the Redis key schema (keys), the Lua scripts (scripts),
the endpoint registry mirrored from SQL (registry) and the retry loop of background jobs
(loop). It imports nothing from queue/, ratelimit/ or lifecycle/, which all build on it."""
