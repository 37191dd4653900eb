"""The router's Prometheus metrics (`tokenmill:router_*`), in a private registry per app."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from tokenmill.router.replicas import ReplicaSet

_MATCH_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)


class RouterMetrics:
    def __init__(self, replicas: ReplicaSet, policy: str) -> None:
        self.replicas = replicas
        self.registry = r = CollectorRegistry()

        def per_replica(kind: type[Counter] | type[Gauge], metric: str, doc: str) -> Counter | Gauge:
            return kind(f"tokenmill:router_{metric}", doc, ["replica"], registry=r)

        self.routed = Counter(
            "tokenmill:router_requests",
            "Requests sent to each replica, by the policy's decision "
            "(affinity: its prefix record matched; balanced: fewest in flight; round_robin).",
            ["replica", "decision"],
            registry=r,
        )
        self.retries = per_replica(
            Counter, "retries", "Requests retried elsewhere after this replica failed before answering."
        )
        self.failures = per_replica(
            Counter, "replica_failures", "Requests this replica failed (no connection, or it dropped the connection)."
        )
        self.unavailable = Counter(
            "tokenmill:router_unavailable", "Requests answered 503 for want of a healthy replica.", registry=r
        )
        self.match = Histogram(
            "tokenmill:router_prefix_match_ratio",
            "Prefix policy: fraction of the routing text found in the chosen replica's record.",
            registry=r,
            buckets=_MATCH_BUCKETS,
        )
        self.healthy = per_replica(Gauge, "replica_healthy", "1 if the replica passed its last health check.")
        self.in_flight = per_replica(Gauge, "requests_in_flight", "Requests the router has in flight on the replica.")
        self.info = Gauge("tokenmill:router_info", "The router's policy.", ["policy"], registry=r)
        self.info.labels(policy).set(1)
        self.policy = policy

    def render(self) -> bytes:
        for replica in self.replicas:
            self.healthy.labels(replica.url).set(1 if replica.healthy else 0)
            self.in_flight.labels(replica.url).set(replica.in_flight)
        return generate_latest(self.registry)
