"""One registry idiom for every pluggable part: a name maps to a lazy ``"pkg.mod:Name"`` loader.

    PROVIDERS = Registry("sandbox provider", group="modal_rl.sandbox_providers")
    PROVIDERS.add("local", "modal_rl.sandboxes.local:LocalProvider")
    cls = PROVIDERS.load("local")          # imports modal_rl.sandboxes.local only now

Invariants:
- registering imports nothing: a target is a dotted path, imported on first ``load`` (so a
  registry of heavy implementations costs nothing until one is chosen);
- a package adds its own parts without editing the core: entry points in ``group`` (the
  entry point's name is the registry name, its value the ``"pkg.mod:Name"`` path) are read on
  the first lookup; a name registered in code wins over an entry point of the same name;
- an unknown name, or a target that does not import, is a ``ValueError`` of one line that
  names the kind, the name and what is known.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any


class Registry:
    def __init__(self, kind: str, group: str | None = None):
        self.kind, self.group = kind, group
        self._targets: dict[str, str] = {}
        self._loaded: dict[str, Any] = {}
        self._scanned = group is None

    def add(self, name: str, target: str) -> None:
        """Register ``name`` as the dotted path ``target`` (``"pkg.mod:Name"``)."""
        if ":" not in target:
            raise ValueError(f"{self.kind} {name!r}: target must be 'pkg.module:Name', got {target!r}")
        self._targets[name] = target
        self._loaded.pop(name, None)

    def _scan(self) -> None:
        if self._scanned:
            return
        self._scanned = True
        for ep in entry_points(group=self.group):
            self._targets.setdefault(ep.name, ep.value)

    def names(self) -> list[str]:
        self._scan()
        return sorted(self._targets)

    def target(self, name: str) -> str:
        self._scan()
        if name not in self._targets:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {self.names()}")
        return self._targets[name]

    def load(self, name: str) -> Any:
        """The object ``name`` stands for, imported on first use."""
        if name not in self._loaded:
            module, _, attr = self.target(name).partition(":")
            try:
                obj = importlib.import_module(module)
                for part in attr.split("."):
                    obj = getattr(obj, part)
            except (ImportError, AttributeError) as exc:
                raise ValueError(f"{self.kind} {name!r}: cannot load {self._targets[name]!r}: {exc}") from exc
            self._loaded[name] = obj
        return self._loaded[name]
