"""A `pc-rag serve` child process on a free loopback port: started, waited for until healthy, stopped; and
SGLang's router in front of several (`RouterProcess`).

For tests and benchmarks that drive a real server with the clients users have.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from ..errors import PCRagError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ChildProcess:
    """A child process on a free loopback port whose output goes to a temporary log (removed at `stop` unless
    $PC_RAG_KEEP_SERVER_LOG=1); used as a context manager, it is started and stopped."""

    log_prefix = "pc_rag_child_"

    def __init__(self):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix=self.log_prefix, suffix=".log")[1])
        self.proc: subprocess.Popen | None = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        raise NotImplementedError

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None
        if os.environ.get("PC_RAG_KEEP_SERVER_LOG") != "1":
            self.log_path.unlink(missing_ok=True)


class ServerProcess(ChildProcess):
    """`python -m pc_rag serve --model MODEL --port <free> *extra` in a child process.

    `env`: the child's environment (default: this one). Its output goes to `log_path`; the error raised when it
    does not come up quotes the end of it.
    """

    log_prefix = "pc_rag_serve_"

    def __init__(self, model, extra=(), env: dict | None = None, startup_timeout_s: float = 180.0):
        super().__init__()
        self.model = str(model)
        self.extra = [str(x) for x in extra]
        self.env = env
        self.startup_timeout_s = startup_timeout_s

    def start(self) -> None:
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the process without waiting for it (start several, then `wait_ready` each: they load at once)."""
        cmd = [sys.executable, "-m", "pc_rag", "serve", "--model", self.model, "--port", str(self.port),
               "--log-level", "warning", *self.extra]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)

    def wait_ready(self) -> None:
        """Wait until /health answers; raise (quoting the log) if the process exits or the time runs out."""
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PCRagError(f"pc-rag serve exited with status {self.proc.returncode}:\n{self.log_tail()}")
            try:
                self.health()
                return
            except (OSError, urllib.error.URLError):
                time.sleep(0.1)
        self.stop()
        raise PCRagError(f"pc-rag serve did not answer /health within {self.startup_timeout_s:g} s:\n"
                         f"{self.log_tail()}")

    def health(self, key: str | None = None) -> dict:
        """/health; with `key` (a server started with API keys), the counts beyond liveness too."""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        with urllib.request.urlopen(urllib.request.Request(self.url + "/health", headers=headers), timeout=5) as r:
            return json.loads(r.read())

    def rss_bytes(self) -> int:
        """The server's resident memory (Linux: VmRSS of /proc/<pid>/status)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise PCRagError("VmRSS not found")



class RouterProcess(ChildProcess):
    """SGLang's router (`python -m sglang_router.launch_router`, the `router` extra: a Rust binary in a wheel) in
    front of `workers` (their base URLs), on a free loopback port, with `policy` (round_robin, cache_aware, ...).
    `python`: the interpreter that has sglang_router (default: this one). `ready_key`: an API key the workers
    require, sent while waiting for the first request to go through. Its output goes to `log_path`."""

    log_prefix = "pc_rag_router_"

    def __init__(self, workers, policy: str = "cache_aware", extra=(), python: str | None = None,
                 startup_timeout_s: float = 60.0, ready_key: str | None = None):
        super().__init__()
        self.workers = list(workers)
        self.policy = policy
        self.extra = [str(x) for x in extra]
        self.python = python or sys.executable
        self.startup_timeout_s = startup_timeout_s
        self.ready_key = ready_key

    def start(self) -> None:
        cmd = [self.python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
               "--worker-urls", *self.workers, "--policy", self.policy, "--log-level", "warn",
               # its metrics listen on a fixed port by default (29000): two routers on one machine would clash
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), *self.extra]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        # Ready once a request goes through to a worker: the router registers its workers in the background.
        headers = {"Authorization": f"Bearer {self.ready_key}"} if self.ready_key else {}
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PCRagError(f"the router exited with status {self.proc.returncode}:\n{self.log_tail()}")
            try:
                request = urllib.request.Request(self.url + "/v1/models", headers=headers)
                with urllib.request.urlopen(request, timeout=5) as r:
                    if r.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.2)
        self.stop()
        raise PCRagError(f"the router did not pass a request within {self.startup_timeout_s:g} s:\n{self.log_tail()}")

