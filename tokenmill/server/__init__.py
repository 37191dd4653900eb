"""The OpenAI-compatible HTTP server (`tokenmill serve`).

- `core_process`: the engine-core process (model + `EngineCore` step loop), fed through queues.
- `engine_client`: the front end's handle on it (output processing, per-request streams, health).
- `protocol`: request schemas and validation, OpenAI error format.
- `serving*`: the completion and chat endpoints' logic; `streaming`: SSE and client disconnects.
- `api`: the FastAPI app; `metrics`: Prometheus collectors and stats logs; `cli`: `serve` flags.
"""
