"""A fault-injecting HTTP proxy for S3 tests: forwards requests to an upstream S3 endpoint
(moto's server) and answers a seeded fraction of them with faults a real object store produces.

Faults, decided per request from one seeded RNG (the order of concurrent requests varies, the
rates do not):

- ``throttle``: ``503 SlowDown`` with S3's XML error body (what S3 sends when it throttles);
- ``drop``: the connection is closed without a response (a reset mid-request);
- ``truncate``: a GET's response headers promise the whole body but only half of it arrives
  before the connection closes (a truncated read).

The request body is always read first, so the faults look the same to the client whatever it
sends. Use as a context manager in tests, or standalone for manual runs::

    python -m tests.support.fault_proxy --upstream http://127.0.0.1:5000 --throttle 0.2 --drop 0.05
"""

from __future__ import annotations

import argparse
import http.client
import random
import signal
import socket
import threading
import uuid
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

SLOW_DOWN_BODY = (
    '<?xml version="1.0" encoding="UTF-8"?>\n'
    "<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message>"
    "<RequestId>{request_id}</RequestId><HostId>fault-proxy</HostId></Error>"
)
# Per-connection headers: the proxy frames its own requests and responses.
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "proxy-connection",
    "te",
    "upgrade",
    "expect",  # the proxy already answered 100-continue and holds the whole body
}


class FaultProxy:
    """Loopback proxy in front of ``upstream`` (``http://host:port``); ``url`` is its address."""

    def __init__(
        self,
        upstream: str,
        *,
        throttle_rate: float = 0.0,
        drop_rate: float = 0.0,
        truncate_rate: float = 0.0,
        seed: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        if throttle_rate + drop_rate + truncate_rate >= 1:
            raise ValueError("fault rates must add up to less than 1")
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream must be http://host:port, got {upstream!r}")
        self.upstream_host, self.upstream_port = parts.hostname, parts.port or 80
        self.rates = {"throttle": throttle_rate, "drop": drop_rate, "truncate": truncate_rate}
        self.rng = random.Random(seed)
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer((host, port), _handler_for(self))
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def decide(self, method: str) -> str:
        """The fault for the next request ("ok" for none)."""
        with self._lock:
            self.counts["requests"] += 1
            r = self.rng.random()
            fault = "ok"
            for kind, rate in self.rates.items():
                if r < rate:
                    fault = kind
                    break
                r -= rate
            if fault == "truncate" and method != "GET":
                fault = "ok"  # only a response body can be cut short
            self.counts[fault] += 1
            return fault

    def snapshot(self) -> dict[str, int]:
        """Requests seen, and how many got each fault ("ok": none); every key present."""
        with self._lock:
            return {key: self.counts[key] for key in ("requests", "ok", *self.rates)}

    def start(self) -> FaultProxy:
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="fault-proxy", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _handler_for(proxy: FaultProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(_ProxyHandler):
        pass

    Handler.proxy = proxy
    return Handler


class _ProxyHandler(BaseHTTPRequestHandler):
    proxy: FaultProxy
    protocol_version = "HTTP/1.1"  # keep-alive, as S3 clients expect

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass  # one line per request would drown the test output

    def _read_body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length is not None:
            return self.rfile.read(int(length))
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return b""

    def _drop(self) -> None:
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _forward(self) -> None:
        body = self._read_body()
        fault = self.proxy.decide(self.command)
        if fault == "drop":
            self._drop()
            return
        if fault == "throttle":
            payload = b""
            if self.command != "HEAD":
                payload = SLOW_DOWN_BODY.format(request_id=uuid.uuid4().hex).encode()
            self.send_response(503, "Slow Down")
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        if body or self.command in ("PUT", "POST"):
            headers["Content-Length"] = str(len(body))
        upstream = http.client.HTTPConnection(
            self.proxy.upstream_host, self.proxy.upstream_port, timeout=60
        )
        try:
            # The Host header is forwarded as the client sent it: it is part of the signature.
            upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for key, value in headers.items():
                upstream.putheader(key, value)
            upstream.endheaders(body or None)
            response = upstream.getresponse()
            data = response.read()
            status, reason, response_headers = (
                response.status,
                response.reason,
                response.getheaders(),
            )
        finally:
            upstream.close()
        self.send_response(status, reason)
        for key, value in response_headers:
            if key.lower() not in _HOP_BY_HOP and key.lower() != "content-length":
                self.send_header(key, value)
        if self.command == "HEAD":
            # A HEAD response announces the length of the body a GET would have.
            length = dict((k.lower(), v) for k, v in response_headers).get("content-length", "0")
            self.send_header("Content-Length", length)
            self.end_headers()
            return
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if fault == "truncate" and len(data) > 1:
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self._drop()
            return
        self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help="http://host:port of the S3 server")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--throttle", type=float, default=0.2, help="fraction answered 503")
    parser.add_argument("--drop", type=float, default=0.0, help="fraction of connections dropped")
    parser.add_argument("--truncate", type=float, default=0.0, help="fraction of GETs cut short")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    proxy = FaultProxy(
        args.upstream,
        throttle_rate=args.throttle,
        drop_rate=args.drop,
        truncate_rate=args.truncate,
        seed=args.seed,
        port=args.port,
    )
    print(f"fault proxy on {proxy.url} -> {args.upstream}", flush=True)
    # A background job ignores SIGINT: stop on SIGTERM too, and print the counts either way.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        proxy._server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        proxy._server.server_close()
        print(f"requests: {proxy.snapshot()}", flush=True)


if __name__ == "__main__":
    main()
