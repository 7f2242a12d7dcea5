"""A real S3-compatible server on loopback for the remote-storage tests (and bench/bench_remote.py).

``moto`` in server mode listens on a free port; a counting proxy in front of it records every request (method,
object key, Range header, response body bytes, request body bytes, the ``x-amz-copy-source`` of a server-side
copy), so tests assert what was transferred on the wire rather than what ckptdoctor says it read or wrote.
The proxy can also be told to drop connections (a server gone mid-run).
"""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

BUCKET = "ckpt"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Request:
    method: str
    key: str  # object key below the bucket ("" for a bucket-level request such as a listing)
    range: str | None
    body_bytes: int
    sent_bytes: int = 0  # the request's body (an upload's bytes)
    copy_source: str | None = None  # a server-side copy (CopyObject, UploadPartCopy): ``bucket/key`` copied


@dataclass
class RequestLog:
    requests: list[Request] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def clear(self) -> None:
        with self.lock:
            self.requests.clear()

    def gets(self) -> list[Request]:
        with self.lock:
            return [r for r in self.requests if r.method == "GET" and r.key]

    def get_bytes(self) -> int:
        return sum(r.body_bytes for r in self.gets())

    def copies(self) -> list[Request]:
        """The server-side copies: no byte of the object passed through the client."""
        with self.lock:
            return [r for r in self.requests if r.copy_source is not None]

    def uploads(self) -> list[Request]:
        """The writes that carried bytes from the client (PutObject, UploadPart)."""
        with self.lock:
            return [r for r in self.requests if r.method == "PUT" and r.copy_source is None and r.key]

    def upload_bytes(self) -> int:
        return sum(r.sent_bytes for r in self.uploads())


class _Proxy(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # TCP_NODELAY: the status line and headers go out in one write and the body in another; with Nagle's
    # algorithm the body waits for the client's delayed ACK of the headers, 40 ms a request (3.5 ms without).
    disable_nagle_algorithm = True
    server: _ProxyServer

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def _forward(self) -> None:
        server = self.server
        if server.drop:
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        conn = http.client.HTTPConnection("127.0.0.1", server.upstream_port, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "proxy-connection")}
        conn.request(self.command, self.path, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
        conn.close()
        path = unquote(urlsplit(self.path).path).lstrip("/")
        key = path.split("/", 1)[1] if "/" in path else ""
        with server.log.lock:
            copied = self.headers.get("x-amz-copy-source")
            server.log.requests.append(
                Request(
                    self.command,
                    key,
                    self.headers.get("Range"),
                    len(data),
                    len(body or b""),
                    unquote(copied).lstrip("/") if copied else None,
                )
            )
        self.send_response(response.status)
        for name, value in response.getheaders():
            if name.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, upstream_port: int, log: RequestLog) -> None:
        super().__init__(("127.0.0.1", 0), _Proxy)
        self.upstream_port = upstream_port
        self.log = log
        self.drop = False


@dataclass
class S3Server:
    """moto on ``moto_port``, reached through the counting proxy at ``endpoint``."""

    process: subprocess.Popen
    proxy: _ProxyServer
    log: RequestLog
    endpoint: str
    moto_endpoint: str

    def env(self, msc_config: Path | None = None) -> dict[str, str]:
        """Environment for a ckptdoctor process: AWS credentials and endpoint (and MSC's config file)."""
        env = {**os.environ, **CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}
        if msc_config is not None:
            env["MSC_CONFIG"] = str(msc_config)
        return env

    def msc_config(self, path: Path, profiles: dict[str, str] | None = None) -> Path:
        """An MSC config file with one profile per bucket (default: ``s3test`` over :data:`BUCKET`), endpoint and
        credentials in each profile."""
        text = "profiles:\n"
        for profile, bucket in (profiles or {"s3test": BUCKET}).items():
            text += (
                f"  {profile}:\n"
                "    storage_provider:\n"
                "      type: s3\n"
                "      options:\n"
                f"        base_path: {bucket}\n"
                f"        endpoint_url: {self.endpoint}\n"
                "        region_name: us-east-1\n"
                "    credentials_provider:\n"
                "      type: S3Credentials\n"
                "      options:\n"
                f"        access_key: {CREDENTIALS['AWS_ACCESS_KEY_ID']}\n"
                f"        secret_key: {CREDENTIALS['AWS_SECRET_ACCESS_KEY']}\n"
            )
        path.write_text(text)
        return path

    def client(self):  # boto3, straight to moto (uploads are not counted)
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.moto_endpoint,
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name="us-east-1",
        )

    def upload_tree(self, local: Path, prefix: str) -> None:
        client = self.client()
        for path in sorted(local.rglob("*")):
            if path.is_file():
                client.upload_file(str(path), BUCKET, f"{prefix}/{path.relative_to(local).as_posix()}")

    def stop(self) -> None:
        self.proxy.shutdown()
        self.proxy.server_close()
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def start() -> S3Server:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError("moto server did not start") from None
            time.sleep(0.1)
    log = RequestLog()
    proxy = _ProxyServer(port, log)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    server = S3Server(process, proxy, log, f"http://127.0.0.1:{proxy.server_address[1]}", f"http://127.0.0.1:{port}")
    server.client().create_bucket(Bucket=BUCKET)
    return server
