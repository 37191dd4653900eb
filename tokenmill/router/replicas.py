"""The router's replicas: their URLs, health and requests in flight, and the periodic health check.

A replica is healthy when its `/health` answered 200 at the last check. It is marked unhealthy by a
failed check (refused connection, timeout, any other status: a draining replica answers 503) or at
once when the router cannot connect to it; the next good check brings it back. Replicas start
unhealthy until their first check.

A check that times out means the replica stopped answering at all (a frozen process, a lost host), not
that it is draining or busy (those answer /health at once): after `STALLED_CHECKS` such checks in a row
the requests waiting on it are given up (`Replica.stalled`), so that none waits forever on a replica
that will not answer, and one slow answer costs no request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

logger = logging.getLogger("tokenmill.router")

STALLED_CHECKS = 2  # health checks timed out in a row before the requests waiting on a replica are given up


@dataclass
class Replica:
    index: int
    url: str  # root URL, no trailing slash and no /v1
    healthy: bool = False
    in_flight: int = 0
    last_error: str | None = None
    timed_out: int = 0  # health checks timed out in a row
    _stalled: asyncio.Future | None = field(default=None, repr=False)

    def stalled(self) -> asyncio.Future:
        """A future that is done once a health check of this replica times out (see the module's doc)."""
        if self._stalled is None or self._stalled.done():
            self._stalled = asyncio.get_running_loop().create_future()
        return self._stalled

    def check_timed_out(self) -> None:
        """A health check timed out: the `STALLED_CHECKS`-th in a row gives up the requests waiting here."""
        self.timed_out += 1
        if self.timed_out >= STALLED_CHECKS and self._stalled is not None and not self._stalled.done():
            self._stalled.set_result(None)


def normalize_url(url: str) -> str:
    """`http://h:p`, `http://h:p/` and `http://h:p/v1` all name the replica at `http://h:p`."""
    url = url.strip().rstrip("/").removesuffix("/v1")
    if "://" not in url:
        url = "http://" + url
    return url


class ReplicaSet:
    """Every replica, by index. `on_unhealthy(index)` runs when one turns unhealthy (the policy forgets
    what it recorded for it: a replica that failed may come back with an empty cache)."""

    def __init__(self, urls: Sequence[str], on_unhealthy: Callable[[int], None] | None = None) -> None:
        urls = [normalize_url(u) for u in urls]
        if not urls:
            raise ValueError("the router needs at least one replica")
        if len(set(urls)) != len(urls):
            raise ValueError(f"a replica is listed twice: {urls}")
        self.replicas = [Replica(i, u) for i, u in enumerate(urls)]
        self.on_unhealthy = on_unhealthy

    def __iter__(self):
        return iter(self.replicas)

    def __len__(self) -> int:
        return len(self.replicas)

    def __getitem__(self, index: int) -> Replica:
        return self.replicas[index]

    @property
    def loads(self) -> list[int]:
        return [r.in_flight for r in self.replicas]

    def healthy(self, exclude: Sequence[int] = ()) -> list[int]:
        return [r.index for r in self.replicas if r.healthy and r.index not in exclude]

    def mark_healthy(self, index: int) -> None:
        replica = self.replicas[index]
        if not replica.healthy:
            logger.info("replica %d (%s) is healthy", index, replica.url)
        replica.healthy, replica.last_error = True, None

    def mark_unhealthy(self, index: int, why: str) -> None:
        replica = self.replicas[index]
        if replica.healthy:
            logger.warning("replica %d (%s) is unhealthy: %s", index, replica.url, why)
        was_healthy, replica.healthy, replica.last_error = replica.healthy, False, why
        if was_healthy and self.on_unhealthy is not None:
            self.on_unhealthy(index)


async def check_replica(client: httpx.AsyncClient, replicas: ReplicaSet, index: int, timeout: float) -> bool:
    """One health check of one replica; updates its state. Returns whether it is healthy."""
    replica = replicas[index]
    try:
        response = await client.get(f"{replica.url}/health", timeout=timeout)
    except httpx.HTTPError as e:
        replicas.mark_unhealthy(index, f"/health failed: {type(e).__name__}: {e}".rstrip(": "))
        if isinstance(e, httpx.TimeoutException):
            replica.check_timed_out()
        else:
            replica.timed_out = 0
        return False
    replica.timed_out = 0
    if response.status_code != 200:
        replicas.mark_unhealthy(index, f"/health answered {response.status_code}")
        return False
    replicas.mark_healthy(index)
    return True


async def check_all(client: httpx.AsyncClient, replicas: ReplicaSet, timeout: float) -> None:
    await asyncio.gather(*(check_replica(client, replicas, r.index, timeout) for r in replicas))


async def health_loop(client: httpx.AsyncClient, replicas: ReplicaSet, interval: float, timeout: float) -> None:
    """Check every replica every `interval` seconds, forever (cancel to stop)."""
    while True:
        await asyncio.sleep(interval)
        try:
            await check_all(client, replicas, timeout)
        except Exception:  # a bug here must not stop the checks
            logger.exception("health check failed")
