"""Where an engine pulls a weight version from: the frame server's address and the version.

A value, handed from the side that publishes (``engines.vllm_push.EnginePusher.publish``, a
relay worker) to the side that has engines load it (``engines.supervisor``, an adapter).

Invariants: frozen; ``host``/``port`` reach a ``FrameServer`` that retains ``version``
(or an anchor and the deltas up to it); ``tls`` says the address is a TLS tunnel;
``epoch`` is the publisher's epoch, signed into the pull (an engine's floor).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightSource:
    """Where engines pull the pool's current weights from (a ``FrameServer``), and which version."""

    host: str
    port: int
    version: int
    tls: bool = False
    epoch: int | None = None  # the publisher's epoch: signed into the pull (engines' floor)
