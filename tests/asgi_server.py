"""An ASGI app served by uvicorn on a free 127.0.0.1 port, in a thread, for a test's duration."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

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
