"""The sandbox providers by name (``SandboxPool`` settings' ``backend``), loaded on first use.

A package adds a provider without editing this file through the entry-point group
``modal_rl.sandbox_providers`` (``name = "pkg.mod:ProviderClass"``); the class builds itself from
the pool settings with ``Provider.from_settings``.
"""

from __future__ import annotations

from modal_rl.registry import Registry

PROVIDERS = Registry("sandbox backend", group="modal_rl.sandbox_providers")
PROVIDERS.add("local", "modal_rl.sandboxes.local:LocalProvider")
PROVIDERS.add("modal", "modal_rl.sandboxes.modal_provider:ModalProvider")
