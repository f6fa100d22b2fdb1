"""Framework adapters declare themselves; the core names none of them.

An adapter package (``verl_modal``, ``slime_modal``, a third one for OpenRLHF) adds one line
to its distribution's entry points::

    [project.entry-points."modal_rl.adapters"]
    my_adapter = "my_adapter"

and every Modal image this project builds carries it as source beside ``modal_rl``
(:func:`shipped_packages`), with no edit to ``modal_rl``.

Invariants:
- ``modal_rl`` is always shipped, first; an adapter's package is the top-level package of its
  entry point's value (``"pkg.sub:obj"`` ships ``pkg``), each name once, sorted;
- nothing is imported to find them: entry points are metadata.

The pip lists of images this project builds come from its own extras
(:func:`extra_requirements`), so a dependency is named once, in ``pyproject.toml``.
"""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, entry_points, requires

GROUP = "modal_rl.adapters"
CORE = "modal_rl"
DISTRIBUTION = "modal-rl"


def shipped_packages() -> tuple[str, ...]:
    """The packages a container needs as source: the core and every declared adapter."""
    declared = {ep.value.partition(":")[0].partition(".")[0] for ep in entry_points(group=GROUP)}
    return (CORE, *sorted(declared - {CORE}))


def extra_requirements(extra: str) -> tuple[str, ...]:
    """The requirements of this project's ``extra`` (``pyproject.toml``), as pip specifiers."""
    try:
        declared = requires(DISTRIBUTION) or []
    except PackageNotFoundError:
        raise RuntimeError(f"{DISTRIBUTION} is not installed: run bash scripts/install.sh") from None
    marker = re.compile(rf"""^(.*?)\s*;\s*extra\s*==\s*["']{re.escape(extra)}["']\s*$""")
    found = tuple(m.group(1) for r in declared if (m := marker.match(r)))
    if not found:
        raise ValueError(f"{DISTRIBUTION} declares no extra {extra!r} (pyproject.toml)")
    return found
