"""The uvicorn server every HTTP front (`serve`, `router`, `disagg-proxy`) runs, configured once here:
no access log, the app's lifespan on, a request head and body that must arrive in time, and room for
many connections.

A client that connects and then sends its request's head slowly, or never (a "slowloris"), would hold a
connection and its file descriptor for as long as it likes: uvicorn's keep-alive timeout only starts
once a response is done. Here a connection whose request head (the request line and the headers) has
not fully arrived `header_timeout` seconds after the connection opened, or after the previous response
on it ended, is closed, as nginx's `client_header_timeout` does; and so is one whose request body has not
fully arrived `header_timeout` seconds after its head (a body sent slowly holds the request's handler
and its buffer too; nginx's `client_body_timeout` bounds the gaps only, so a byte a minute passes it). The open-files limit is raised to its
hard limit (at most 65,536, as vLLM's server does) so that many clients at once do not run out of
descriptors first.

Uvicorn only: the router and the proxy import it without torch.
"""

from __future__ import annotations

import resource

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_HEADER_TIMEOUT = 30.0  # seconds
OPEN_FILES = 65536


def raise_open_files_limit(want: int = OPEN_FILES) -> None:
    """The soft limit on open files up to `want` (not past the hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def header_deadline_protocol(seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose next request head, or whose request's body after
    its head, takes longer than `seconds`."""

    class HeaderDeadline(H11Protocol):
        _timer = None
        _waiting_after = None  # the request cycle whose successor's head is awaited (None: the first)
        _body_of = None  # the request cycle whose body is awaited

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            cycle = self.cycle
            if cycle is self._waiting_after:  # still the head
                return
            if not cycle.more_body:  # the whole request is in
                self._disarm()
            elif cycle is not self._body_of:  # its head is in: the body's deadline starts
                self._disarm()
                self._body_of = cycle
                self._timer = self.loop.call_later(seconds, self._body_too_slow, cycle)

        def on_response_complete(self) -> None:
            self._arm()  # before: a pipelined request's head may be parsed in there (then the timer is moot)
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._waiting_after = self.cycle
            self._timer = self.loop.call_later(seconds, self._too_slow)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _too_slow(self) -> None:
            self._timer = None
            if self.cycle is self._waiting_after and not self.transport.is_closing():
                self.transport.close()

        def _body_too_slow(self, cycle) -> None:
            self._timer = None
            if self.cycle is cycle and cycle.more_body and not self.transport.is_closing():
                self.transport.close()  # the handler reading the body gets http.disconnect

    return HeaderDeadline


def uvicorn_config(app, log_level: str, graceful_shutdown: float, header_timeout: float) -> uvicorn.Config:
    """The server's config for `app` (`header_timeout` 0: no deadline for a request's head and body)."""
    raise_open_files_limit()
    protocol = header_deadline_protocol(header_timeout) if header_timeout > 0 else "h11"
    return uvicorn.Config(
        app,
        log_level=log_level,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=graceful_shutdown,
        http=protocol,
    )
