"""The read-only view of the host that a ``LocalProvider`` sandbox in host mode gets."""

from __future__ import annotations

import os
import sys
from pathlib import Path

_ETC_FILES = [
    "passwd",
    "group",
    "hosts",
    "nsswitch.conf",
    "host.conf",
    "resolv.conf",
    "gai.conf",
    "protocols",
    "services",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "alternatives",
    "ssl",
    "ca-certificates",
    "mime.types",
]


def host_root_args() -> tuple[list[str], list[str]]:
    """Read-only binds that make the host's userland and this Python usable; returns (args, PATH)."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = Path("/") / top
        if host.is_symlink():
            args += ["--symlink", os.readlink(host), str(host)]
        elif host.is_dir():
            args += ["--ro-bind", str(host), str(host)]
    for name in _ETC_FILES:
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    path = ["/usr/local/bin", "/usr/bin", "/bin"]
    python = os.path.realpath(sys.executable)
    prefixes = {os.path.realpath(sys.base_prefix)}
    # A venv's prefix is bound only when the interpreter itself lives there: the agent runs
    # with -I -S (no site-packages), and a venv under /tmp would otherwise put a /tmp on the
    # frozen root where the work dir's /tmp symlink has to go.
    if python.startswith(os.path.realpath(sys.prefix) + os.sep):
        prefixes.add(os.path.realpath(sys.prefix))
    for prefix in prefixes:
        if not prefix.startswith("/usr/"):
            args += ["--ro-bind", prefix, prefix]
    path.insert(0, os.path.dirname(python))
    return args, path
