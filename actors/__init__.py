"""The engine: actors, messages, request state, scheduling, KV block bookkeeping."""
