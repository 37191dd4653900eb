"""The HTTP fronts' shared error handling (`tokenmill/http_front.py`) and server (`tokenmill/http_server.py`)
on a real uvicorn server: an error no handler takes is a JSON 500, and the client's connection serves its
next request; a connection that does not send a request's head, or then its body, in time is closed."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import resource
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from test_server_utils import free_port

from tokenmill.cli_args import listening_socket
from tokenmill.http_front import APIError, install_error_handlers
from tokenmill.http_server import OPEN_FILES, uvicorn_config

HEADER_TIMEOUT = 1.0  # seconds: the fronts' default is 30


@pytest.fixture(scope="module")
def url():
    app = FastAPI()
    install_error_handlers(app, logging.getLogger("test_http_front"))

    @app.get("/boom")
    async def boom():
        raise RuntimeError("a bug")

    @app.get("/refused")
    async def refused():
        raise APIError(400, "x must be y", "invalid_request_error", param="x")

    @app.get("/ok")
    async def ok():
        return {"ok": True}

    @app.post("/echo")
    async def echo(request: Request):
        return {"bytes": len(await request.body())}

    @app.get("/slow")
    async def slow():
        await asyncio.sleep(3 * HEADER_TIMEOUT)  # the head came in time: the answer may take longer
        return {"ok": True}

    port = free_port()
    config = uvicorn_config(app, "critical", 5, HEADER_TIMEOUT)
    config.host, config.port = "127.0.0.1", port
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    yield ("127.0.0.1", port)
    server.should_exit = True
    thread.join(30)


def get(conn: http.client.HTTPConnection, path: str) -> tuple[int, dict]:
    conn.request("GET", path)
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def test_an_unhandled_error_is_a_json_500_and_the_connection_serves_on(url, caplog):
    conn = http.client.HTTPConnection(*url, timeout=30)  # one keep-alive connection for every request
    try:
        with caplog.at_level(logging.ERROR, logger="test_http_front"):
            status, body = get(conn, "/boom")
        assert status == 500 and body["error"]["type"] == "internal_server_error"
        assert "a bug" not in json.dumps(body)  # no internals reach the client
        assert any("GET /boom" in r.getMessage() for r in caplog.records)  # ... the log has them
        assert get(conn, "/ok") == (200, {"ok": True})
        status, body = get(conn, "/refused")
        assert status == 400 and body["error"]["param"] == "x"
        assert get(conn, "/ok") == (200, {"ok": True})
    finally:
        conn.close()


def _closed_by_the_server(sock: socket.socket) -> bool:
    """Whether the server closes `sock` (within a minute: far past the deadline, so no busy machine is late)."""
    sock.settimeout(60)
    try:
        while data := sock.recv(4096):
            assert b"HTTP/1.1 200" in data  # an answer to a complete request before, then the close
        return True
    except TimeoutError:
        return False


def test_a_connection_that_does_not_send_a_request_head_in_time_is_closed(url):
    with socket.create_connection(url) as silent, socket.create_connection(url) as trickling:
        trickling.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n")  # the head's blank line never comes
        assert _closed_by_the_server(silent)
        assert _closed_by_the_server(trickling)
    with socket.create_connection(url) as kept:  # on a kept-alive connection, each request's head alike
        kept.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.2)
        kept.sendall(b"GET /ok HTTP/1.1\r\n")
        assert _closed_by_the_server(kept)


def test_a_connection_that_does_not_send_a_request_body_in_time_is_closed(url, caplog):
    head = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: 100\r\n\r\n"
    caplog.set_level(logging.INFO, logger="test_http_front")
    with socket.create_connection(url) as stalled:
        stalled.sendall(head + b"x" * 10)  # 90 bytes never come
        assert _closed_by_the_server(stalled)
    with socket.create_connection(url) as trickling:  # a byte every 0.2 s: the deadline bounds the whole body
        trickling.sendall(head.replace(b"100", b"100000"))
        trickling.settimeout(0.2)
        end, closed = time.monotonic() + 60, False
        while not closed and time.monotonic() < end:
            try:
                trickling.sendall(b"x")
                closed = trickling.recv(4096) == b""
            except TimeoutError:
                pass  # nothing to read: still open
            except (BrokenPipeError, ConnectionResetError):
                closed = True
        assert closed
    end = time.monotonic() + 60  # the handlers of both heard that their clients went: a line at info, no error
    while sum("went before its request body" in r.getMessage() for r in caplog.records) < 2:
        assert time.monotonic() < end, [r.getMessage() for r in caplog.records]
        time.sleep(0.05)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    conn = http.client.HTTPConnection(*url, timeout=60)  # a body sent at once is read
    try:
        conn.request("POST", "/echo", body=b"y" * 100_000)
        r = conn.getresponse()
        assert (r.status, json.loads(r.read())) == (200, {"bytes": 100_000})
    finally:
        conn.close()


def test_a_request_whose_head_came_in_time_may_take_longer(url):
    conn = http.client.HTTPConnection(*url, timeout=60)
    try:
        assert get(conn, "/slow") == (200, {"ok": True})
        assert get(conn, "/ok") == (200, {"ok": True})  # the connection serves on
    finally:
        conn.close()


def test_the_open_files_limit_is_raised(url):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft == resource.RLIM_INFINITY or soft >= (
        OPEN_FILES if hard == resource.RLIM_INFINITY else min(OPEN_FILES, hard)
    )


def test_connections_to_a_fronts_listening_socket_send_without_waiting_for_acks():
    """`serve`, `router`, `disagg-proxy` and the KV transfer server hand uvicorn the socket that
    `listening_socket` bound; the connections asyncio accepts on it (as uvicorn's `serve(sockets=...)` does)
    have Nagle's algorithm off. With it on, a response written as head, then body waited for the client's
    delayed ACK of the head: 40 ms on every request after a connection's first."""
    sock = listening_socket("127.0.0.1", 0)

    async def accepted_nodelay() -> int:
        loop = asyncio.get_running_loop()
        seen = loop.create_future()

        class Accept(asyncio.Protocol):
            def connection_made(self, transport):
                s = transport.get_extra_info("socket")
                seen.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await loop.create_server(Accept, sock=sock)
        try:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            try:
                return await asyncio.wait_for(seen, 60)
            finally:
                writer.close()
        finally:
            server.close()

    assert sock.proto == socket.IPPROTO_TCP
    assert asyncio.run(accepted_nodelay()) != 0
