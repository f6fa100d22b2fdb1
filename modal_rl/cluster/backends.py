"""Cluster backends by name: the one place a ``--backend`` value becomes an object.

``local`` and ``modal`` are registered here as dotted paths (imported only when chosen); a
package adds another through the ``modal_rl.cluster_backends`` entry-point group, without
editing this file (``modal_rl.registry``).
"""

from __future__ import annotations

from typing import Any

from modal_rl.registry import Registry

BACKENDS = Registry("cluster backend", group="modal_rl.cluster_backends")
BACKENDS.add("local", "modal_rl.cluster.backend_local:LocalBackend")
BACKENDS.add("modal", "modal_rl.cluster.backend_modal:ModalBackend")


def get_backend(name: str, **kwargs: Any):
    """The backend ``name`` (a ``ClusterBackend``), made with ``kwargs``."""
    return BACKENDS.load(name)(**kwargs)
