"""Data parallelism: a cache-aware router in front of several `tokenmill serve` replicas.

- `policy`: pure routing logic (round-robin, least-load, prefix affinity over per-replica prefix tables).
- `prompt`: the text a request is routed on (prompt, or rendered chat messages).
- `replicas`: replica state (health, requests in flight) and the periodic health check.
- `upstream`: header filtering, client disconnects, streamed pass-through responses.
- `app`: the FastAPI proxy (routing, one retry elsewhere, 503 with none healthy); `metrics`: its counters.
- `launcher`: N local `tokenmill serve` subprocesses (`serve --data-parallel-size N`).
- `cli`: `tokenmill router` and the data-parallel `serve`.
"""
