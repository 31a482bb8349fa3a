"""The KV transport: moving a request's KV blocks between worker ranks over
per-pair process groups (no Ray; nothing here imports anything above it)."""
