"""`tokenmill bench`: a load generator and report for any OpenAI-compatible server (and the engine offline).

Modules: `datasets` (workloads of real text with exact token lengths), `client` (async streaming client and
arrival process), `metrics` (pure functions on per-request records), `prometheus` (server /metrics),
`monitor` (CPU/GPU/KV sampling during a run), `runner` (one run / a sweep), `report` (terminal table, JSON),
`plots` (PNG charts), `offline` (the engine in-process) and `cli` (the `tokenmill bench` subcommands).
"""
