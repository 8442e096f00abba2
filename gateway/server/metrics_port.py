"""``/metrics`` on its own address and port (``metrics.port``), in a thread of the
serving process. The CLI turns on prometheus_client's multiprocess mode first, so
this process reads every worker's values from PROMETHEUS_MULTIPROC_DIR."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess

from gateway.server.auth import digest_allowed, key_digest


def serve_metrics_port(host: str, port: int, key_hashes: Sequence[str]) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] != "/metrics":
                self.send_error(404)
                return
            digest = key_digest(self.headers.get("Authorization"), self.headers.get("x-api-key"))
            if key_hashes and not digest_allowed(digest, key_hashes):
                self.send_error(401)
                return
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # no access log
            return

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="metrics-port", daemon=True).start()
    return server
