"""`--kv-role` and `--kv-transfer-config`: how a `tokenmill serve` engine takes part in disaggregated
prefill/decode (the fields follow vLLM's KVTransferConfig)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

KV_ROLES = ("producer", "consumer")
RANK_OF_ROLE = {"producer": 0, "consumer": 1}


@dataclass(frozen=True)
class KVTransferConfig:
    """`kv_connector`: a name in `tokenmill.kv_transfer.CONNECTORS`; `kv_rank`: 0 the producer (prefill,
    it hosts the rendezvous store), 1 the consumer (decode); `kv_parallel_size`: ranks in the transfer
    group (2: one producer, one consumer); `kv_ip` / `kv_port`: the producer's torch.distributed
    TCPStore; `kv_timeout`: seconds a transfer (or the rendezvous) may take before it fails."""

    kv_role: str
    kv_connector: str = "TorchDistributedConnector"
    kv_rank: int | None = None
    kv_parallel_size: int = 2
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_timeout: float = 30.0

    def __post_init__(self) -> None:
        from tokenmill.kv_transfer import CONNECTORS

        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if self.kv_connector not in CONNECTORS:
            raise ValueError(f"kv_connector must be one of {', '.join(CONNECTORS)}, got {self.kv_connector!r}")
        if self.kv_parallel_size != 2:
            raise ValueError(
                f"kv_parallel_size must be 2 (one producer and one consumer), got {self.kv_parallel_size!r}"
            )
        rank = RANK_OF_ROLE[self.kv_role]
        if self.kv_rank is None:
            object.__setattr__(self, "kv_rank", rank)
        elif self.kv_rank != rank:
            raise ValueError(
                f"kv_rank must be {rank} for a {self.kv_role} (0 = producer, 1 = consumer), got {self.kv_rank!r}"
            )
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise ValueError(f"kv_ip must be a host name or address, got {self.kv_ip!r}")
        if not isinstance(self.kv_port, int) or isinstance(self.kv_port, bool) or not 0 < self.kv_port < 65536:
            raise ValueError(f"kv_port must be a TCP port in 1..65535, got {self.kv_port!r}")
        if (
            not isinstance(self.kv_timeout, (int, float))
            or isinstance(self.kv_timeout, bool)
            or not self.kv_timeout > 0
        ):
            raise ValueError(f"kv_timeout must be a positive number of seconds, got {self.kv_timeout!r}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role == "producer"

    @classmethod
    def from_args(cls, role: str | None, text: str | None) -> KVTransferConfig | None:
        """From `--kv-role` and `--kv-transfer-config` (a JSON object); None when neither is given.
        ValueErrors name the flag or the JSON field at fault."""
        if role is None and text is None:
            return None
        try:
            data = json.loads(text) if text is not None else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-transfer-config is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError("--kv-transfer-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"--kv-transfer-config: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        if role is not None and data.get("kv_role", role) != role:
            raise ValueError(f"--kv-transfer-config: kv_role {data['kv_role']!r} contradicts --kv-role {role}")
        data.setdefault("kv_role", role)
        if data["kv_role"] is None:
            raise ValueError("--kv-role (producer or consumer) is required with --kv-transfer-config")
        try:
            return cls(**data)
        except ValueError as e:
            raise ValueError(f"--kv-transfer-config: {e}") from None
