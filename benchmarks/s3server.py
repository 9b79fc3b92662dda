"""A local S3-compatible server for the tests and benchmarks: moto's server mode on 127.0.0.1.

The server speaks S3's HTTP API (ranged GETs, PUTs, listings, multipart uploads) from memory, as s3fs's own CI uses
it. It checks no credentials by default; `S3Server.env` holds fake ones, so a secret value can be looked for in
everything the code under test writes. A launch finds the server through `AWS_ENDPOINT_URL`, as a job finds MinIO or
any other S3-compatible store.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
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

    def bucket(self, prefix: str = "ucp") -> str:
        """A new, empty bucket's name."""
        import boto3

        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1").create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        """Stop serving (what a store that went down looks like to a client)."""
        self.server.stop()

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
