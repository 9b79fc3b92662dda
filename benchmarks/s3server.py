"""Local S3-compatible servers for the tests and benchmarks, on 127.0.0.1.

- `s3_server()`: moto's server mode, for the tests. It speaks S3's HTTP API (ranged GETs, PUTs, listings, multipart
  uploads) from memory, as s3fs's own CI uses it, and can throttle and check signatures. It checks no credentials
  by default; `S3Server.env` holds fake ones, so a secret value can be looked for in everything the code under test
  writes. A ranged GET costs it time in proportion to the whole object, so its timings describe moto.
- `s3rver_server()`: s3rver (the npm package), for the benchmarks' timings: objects in files, a ranged GET costs
  what the range costs. `benchmarks/setup.sh` installs it into `benchmarks/.tools`; `S3RVER_BIN` names another.

A launch finds either server through `AWS_ENDPOINT_URL`, as a job finds MinIO or any other S3-compatible store.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SECRET = "ucp-test-secret-9f3c1e7a"
"""The fake secret key the server's clients use: no file, log or error may contain it."""


@dataclass
class S3Server:
    """A running server: its endpoint, the environment a client needs to reach it, and a way to stop it."""

    endpoint: str
    server: Any = field(repr=False)
    env: dict[str, str] = field(default_factory=dict)
    _throttled: list[int] = field(default_factory=lambda: [0], repr=False)
    log: Path | None = None
    """s3rver's log (`s3rver_server(log=True)`), one line per request among its other messages."""

    def bucket(self, prefix: str = "ucp") -> str:
        """A new, empty bucket's name."""
        import boto3

        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1").create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        """Stop serving (what a store that went down looks like to a client)."""
        self.server.stop()

    @property
    def name(self) -> str:
        """What serves, for a table: "moto" or "s3rver"."""
        return "s3rver" if isinstance(self.server, _Process) else "moto"

    def requests(self) -> int:
        """The HTTP requests served so far (what a client costs the store beyond bytes); needs `log=True`. s3rver logs a
        request once its response is sent: wait a moment after the client has it."""
        if self.log is None:
            raise RuntimeError("requests are counted only for s3rver_server(log=True)")
        return logged_requests(self.log)[0]

    def throttle(self, requests: int) -> None:
        """Answer the next `requests` GETs with 503 SlowDown, as S3 does when a prefix gets more than it serves."""
        self._throttled[0] = requests


class _Throttle:
    """WSGI middleware in front of moto: a GET while `left[0]` is positive gets S3's 503 SlowDown."""

    BODY = (
        b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
        b"<Message>Please reduce your request rate.</Message></Error>"
    )

    def __init__(self, app: Any, left: list[int]):
        self.app, self.left = app, left

    def __call__(self, environ: dict, start_response: Any) -> Any:
        if self.left[0] > 0 and environ.get("REQUEST_METHOD") == "GET":
            self.left[0] -= 1
            start_response(
                "503 Slow Down", [("Content-Type", "application/xml"), ("Content-Length", str(len(self.BODY)))]
            )
            return [self.BODY]
        return self.app(environ, start_response)


@contextmanager
def s3_server() -> Iterator[S3Server]:
    """Start a server on a free port of 127.0.0.1 and point this process's AWS environment at it until the block
    ends; launches inherit it."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = {
        "AWS_ACCESS_KEY_ID": "ucptestkeyid",
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    found = S3Server(endpoint, server, env)
    server._server.app = _Throttle(server._server.app, found._throttled)  # moto's werkzeug server, in this process
    try:
        yield found
    finally:
        try:
            server.stop()
        except Exception:  # already stopped by a test of a store that went down
            pass
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


S3RVER_VERSION = "3.7.1"
S3RVER_KEY = "S3RVER"
"""s3rver's fixed access key id and secret (it accepts no others)."""
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_REQUEST_LINE = re.compile(r"\b(\d+) \d+ms (?:([\d.]+)([kmgtp]?)b|-)\s*$")
"""How s3rver (koa-logger) ends the line it logs for each response: `STATUS 12ms 3.45kb` (or `-`: no length)."""
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "p": 2**50}


def logged_requests(log: Path) -> tuple[int, int]:
    """The requests s3rver has logged in `log` so far, and the bytes its ranged GETs (206) sent: a worker counts its
    own from the file the server names. The bytes are as s3rver rounds them (3 digits); its log names no method,
    so a HEAD's 200 (the object's length, sent no body) cannot be told from a GET's."""
    requests = ranged = 0
    with open(log, errors="replace") as f:
        for line in f:
            found = _REQUEST_LINE.search(_ANSI.sub("", line))
            if found:
                requests += 1
                if found[1] == "206" and found[2]:
                    ranged += round(float(found[2]) * _UNITS[found[3]])
    return requests, ranged


def s3rver_binary() -> Path | None:
    """s3rver's command: `S3RVER_BIN`, else what `benchmarks/setup.sh` installed, else one on PATH; None if none."""
    named = os.environ.get("S3RVER_BIN")
    local = Path(__file__).resolve().parent / ".tools" / "node_modules" / ".bin" / "s3rver"
    for candidate in (named, str(local), shutil.which("s3rver")):
        if candidate and Path(candidate).is_file() and shutil.which("node"):
            return Path(candidate)
    return None


@dataclass
class _Process:
    """A server run as a child process, stopped by terminating it."""

    process: subprocess.Popen[bytes]
    data: tempfile.TemporaryDirectory[str]
    log: Path | None = None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.data.cleanup()
        if self.log is not None:
            self.log.unlink(missing_ok=True)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def s3rver_server(data_dir: Path | None = None, log: bool = False) -> Iterator[S3Server]:
    """Start s3rver on a free port of 127.0.0.1, its objects in a temporary folder (under `data_dir` if given), and
    point this process's AWS environment at it until the block ends; launches inherit it. With `log`, it logs each
    request to a file beside that folder, so `S3Server.requests()` can count them (silent otherwise: logging costs
    it time)."""
    binary = s3rver_binary()
    if binary is None:
        raise RuntimeError("s3rver is not installed: run benchmarks/setup.sh (it needs Node.js and npm)")
    port = _free_port()
    data = tempfile.TemporaryDirectory(prefix="s3rver-", dir=data_dir)
    # the log stays out of the objects' folder, where s3rver would take a file for a bucket's
    log_path = Path(data.name + ".log") if log else None
    with open(log_path, "wb") if log_path else contextlib.nullcontext(subprocess.DEVNULL) as out:
        process = subprocess.Popen(
            [str(binary), "-d", data.name, "-a", "127.0.0.1", "-p", str(port), *([] if log else ["-s"])],
            # s3rver's ListObjectsV2 continuation tokens use DES, which Node 17+ (OpenSSL 3) has only in its legacy
            # provider: without it any truncated listing (max-keys below the count, as `exists` asks) is a 500
            env={**os.environ, "NODE_OPTIONS": f"{os.environ.get('NODE_OPTIONS', '')} --openssl-legacy-provider"},
            stdout=out,
            # an unread pipe would stall a server that logs: its errors go to the log with the rest
            stderr=subprocess.STDOUT if log_path else subprocess.PIPE,
        )
    server = _Process(process, data, log_path)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                if process.stderr:
                    error = process.stderr.read().decode(errors="replace")[-2000:]
                else:
                    error = log_path.read_text(errors="replace")[-2000:] if log_path else ""
                server.stop()
                raise RuntimeError(f"s3rver did not start on port {port}: {error}") from None
            time.sleep(0.05)
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        "AWS_ACCESS_KEY_ID": S3RVER_KEY,
        "AWS_SECRET_ACCESS_KEY": S3RVER_KEY,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield S3Server(endpoint, server, env, log=log_path)
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
