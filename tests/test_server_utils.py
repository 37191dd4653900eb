"""Helpers for the server tests: start `tokenmill serve` as a real subprocess on a free port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tokenmill.ports import free_port

MODEL = "smollm2-135m-instruct"
STARTUP_TIMEOUT = 300  # seconds; a loaded 2-core machine can be slow to import torch and load weights


def model_available() -> bool:
    from tokenmill.loader.source import resolve_model

    try:
        resolve_model(MODEL)
    except (FileNotFoundError, ValueError):
        return False
    return True


def healthy(url: str) -> bool:
    """Whether the server at `url` answers /health with 200 now."""
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


class ServerProcess:
    """`python -m tokenmill.server.cli serve ...` with its output in a log file."""

    def __init__(self, log_dir: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["--model", MODEL, "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.log_path = Path(log_dir) / f"server-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> ServerProcess:
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
        env.pop("TOKENMILL_API_KEY", None)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tokenmill.server.cli", "serve", *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode} during startup:\n{self.log()}")
            if healthy(self.url):
                return self
            time.sleep(0.25)
        self.stop()
        pytest.fail(f"server not ready after {STARTUP_TIMEOUT}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def openai_client(self, api_key: str = "unused", asynchronous: bool = False):
        """The official OpenAI client (sync or async) pointed at this server, no retries."""
        import openai

        cls = openai.AsyncOpenAI if asynchronous else openai.OpenAI
        return cls(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=300)

    def core_pid(self) -> int:
        """The engine-core child (multiprocessing also starts a small resource-tracker child)."""
        cores = [c for c in psutil.Process(self.proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]
        assert len(cores) == 1, f"expected one engine-core child process, got {cores}"
        return cores[0].pid

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int | None:
        """Signal the server and wait for it; kill it (and its children) if it hangs."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            children = []
            try:
                children = psutil.Process(self.proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                pass
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                for p in [psutil.Process(self.proc.pid), *children]:
                    try:
                        p.kill()
                    except psutil.NoSuchProcess:
                        pass
                self.proc.wait(10)
                pytest.fail(f"server did not exit within {timeout}s of signal {sig}:\n{self.log()}")
        return self.proc.returncode


def running_server(tmp_path_factory, name: str, *args: str):
    """Body of a module-scoped server fixture: `yield from running_server(...)`. Asserts the
    server exits cleanly (status 0) when the module is done."""
    srv = ServerProcess(tmp_path_factory.mktemp(name), *args).start()
    try:
        yield srv
    finally:
        code = srv.stop()
    assert code == 0, srv.log()


TINY_CHAT_KEY = "test-key"  # the API key of conftest's `tiny_chat` server
# the arguments of the `add` tool the API tests declare, in each API's own tool shape
ADD_ARGUMENTS = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
        "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
    },
    "required": ["a", "b"],
}


def tiny_chat_server(tmp_path_factory, tokenizer, name: str, *args: str):
    """Body of a fixture serving a tiny random Llama with the default model's tokenizer and chat template
    as "tiny", with the qwen3 reasoning parser (the chat APIs' tests), plus `args`."""
    from helpers import make_tiny_model

    directory = tmp_path_factory.mktemp(f"tiny-{name}")
    make_tiny_model("llama-gqa-untied", directory, vocab_size=len(tokenizer.hf))
    tokenizer.hf.save_pretrained(directory)
    yield from running_server(
        tmp_path_factory,
        name,
        *("--model", str(directory), "--served-model-name", "tiny", "--reasoning-parser", "qwen3"),
        *("--num-kv-blocks", "256", "--max-model-len", "1024", "--log-interval", "0"),
        *args,
    )


def wait_gone(pid: int, timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid):
            return True
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def metric_values(url: str, headers: dict | None = None) -> dict[str, float]:
    """Every sample on /metrics as {'name{label="v",...}': value} (labels sorted, model_name dropped)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            key = s.name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
            values[key] = s.value
    return values


def sse_events(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE response, in order."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            events.append(line[len("data: ") :])
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return events


def wait_pool_whole(url: str, timeout: float = 30) -> None:
    """Wait until every KV block of the server at `url` is back in its free pool (aborts are processed
    at the core's next step)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metric_values(url)
        if m["tokenmill:num_free_kv_blocks"] == m["tokenmill:num_kv_blocks"]:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"KV blocks not all free after {timeout} s: {m['tokenmill:num_free_kv_blocks']} free")
        time.sleep(0.1)
