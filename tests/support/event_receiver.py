"""A minimal CloudEvents HTTP receiver (as a KServe logger sink): keeps each POST's headers and body."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class ReceivedPost:
    """One POST: its headers (lower-case names) and body."""

    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class EventReceiver:
    """Answers every POST with `status` (after `delay_s`), keeping what it got."""

    def __init__(self, status: int = 200, delay_s: float = 0.0) -> None:
        self.posts: list[ReceivedPost] = []
        self.status, self.delay_s = status, delay_s
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the sink expects

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if receiver.delay_s:
                    time.sleep(receiver.delay_s)
                if 200 <= receiver.status < 300:
                    receiver.posts.append(ReceivedPost({k.lower(): v for k, v in self.headers.items()}, body))
                self.send_response(receiver.status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:  # keep the test output quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/events"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def of_type(self, kind: str) -> list[ReceivedPost]:
        """The binary-mode events of one ce-type."""
        return [p for p in self.posts if p.headers.get("ce-type") == kind]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
