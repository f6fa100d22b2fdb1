"""An ASGI app served by uvicorn on a free 127.0.0.1 port, in a thread, for a test's duration;
and an app that records what reaches it behind a guard."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from modal_rl.cluster.backend_local import free_ports


@contextlib.contextmanager
def serve_on_loopback(app) -> Iterator[str]:
    """Yields the server's ``http://127.0.0.1:<port>`` once it accepts; stops it after."""
    import uvicorn

    (port,) = free_ports(1, "127.0.0.1")
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(10)


def recording_app(reply: bytes, record: Callable[[dict, bytes], None]):
    """An ASGI app that reads each HTTP request's whole body, calls ``record(scope, body)``
    and answers 200 with ``reply``; other scopes (lifespan) are ignored."""

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        record(scope, body)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": reply})

    return app
