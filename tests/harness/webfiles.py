"""A small web server on 127.0.0.1 in a thread that answers GET with fixed bodies
(pictures for remote image URLs, and the like)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def serve_files(routes: dict[str, tuple[int, bytes]]) -> ThreadingHTTPServer:
    """A started server answering GET PATH with ROUTES[PATH] (status, body), else 404;
    its port is ``server_address[1]``; stop it with ``shutdown()``."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, body = routes.get(self.path, (404, b""))
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv
