"""The HTTP fronts' shared error handling (`tokenmill/http_front.py`) on a real uvicorn server: an error
no handler takes is a JSON 500, and the client's connection serves its next request."""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI
from test_server_utils import free_port

from tokenmill.http_front import APIError, install_error_handlers


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

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
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
