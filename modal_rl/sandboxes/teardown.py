"""Last-resort teardown hooks: SIGINT/SIGTERM handlers and atexit, chained, never swallowing.

A handler first runs ``kill`` (synchronous: it must work while the event loop is stuck), then
does what the previous handler would have done: call it (KeyboardInterrupt, asyncio.run's
SIGINT cancellation) or, for the default action, re-deliver the signal to the process.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
from collections.abc import Callable


class EmergencyTeardown:
    """Installs ``kill`` on SIGINT/SIGTERM (main thread only) and at exit; ``remove`` undoes it."""

    def __init__(self, kill: Callable[[], None], *, signals: bool = True):
        self.kill, self.signals = kill, signals
        self._installed: dict[int, tuple[object, Callable]] = {}

    def install(self) -> None:
        atexit.register(self.kill)
        if not self.signals or threading.current_thread() is not threading.main_thread():
            return  # Python only lets the main thread set signal handlers
        for sig in (signal.SIGINT, signal.SIGTERM):
            prev = signal.getsignal(sig)

            def handler(signum, frame, prev=prev):
                self.kill()
                if callable(prev):
                    prev(signum, frame)
                elif prev == signal.SIG_DFL:
                    signal.signal(signum, signal.SIG_DFL)
                    os.kill(os.getpid(), signum)

            signal.signal(sig, handler)
            self._installed[sig] = (prev, handler)

    def remove(self) -> None:
        atexit.unregister(self.kill)
        for sig, (prev, ours) in self._installed.items():
            if signal.getsignal(sig) is ours:  # someone chained after us: leave theirs alone
                signal.signal(sig, prev)
        self._installed.clear()
