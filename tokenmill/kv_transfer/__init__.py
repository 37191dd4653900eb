"""Disaggregated prefill/decode: a producer engine prefills prompts and sends their KV blocks to a
consumer engine, which decodes (`tokenmill serve --kv-role producer|consumer`, `tokenmill disagg-proxy`).

`base.py` (the KV connector seam: a scheduler half in the engine core, a worker half by the KV caches),
`disaggregated.py` (both halves for prefill/decode), `config.py` (the flags), `connector.py` (the
transport interface) and two transports — `torch_distributed.py` (send/recv in a 2-rank gloo / NCCL
group) and `shared_memory.py` (one host) — and `proxy.py` (the OpenAI-compatible front)."""

from __future__ import annotations


def _torch_distributed():
    from tokenmill.kv_transfer.torch_distributed import TorchDistributedConnector

    return TorchDistributedConnector


def _shared_memory():
    from tokenmill.kv_transfer.shared_memory import SharedMemoryConnector

    return SharedMemoryConnector


# transport (`kv_connector`) name -> its class (imported on use: the flags are checked without torch)
CONNECTORS = {"TorchDistributedConnector": _torch_distributed, "SharedMemoryConnector": _shared_memory}
