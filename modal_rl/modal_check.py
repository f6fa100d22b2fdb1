"""Before a launcher talks to Modal: are there credentials, and does the server answer?

:func:`check_modal_access` runs first in every entry point that is about to contact Modal
(not for ``--dry-run`` / ``--preflight-only``, which build Modal objects offline), so a
missing token or a network without a route to Modal is one line in about a second instead
of a traceback after minutes of preflight, or a 60 s hang.

- Credentials are read the way the Modal client reads them (``modal.config``: the
  ``MODAL_TOKEN_ID`` / ``MODAL_TOKEN_SECRET`` variables, else the active profile of
  ``~/.modal.toml`` or ``MODAL_CONFIG_PATH``, ``MODAL_PROFILE`` choosing one); a missing or
  half-given token, or a profile that is not in the file, fails *before any network traffic*
  (:class:`~modal_rl.cli_errors.UserError`, exit 2). Whether the token is valid only the
  server can say; its refusal is mapped to one line by ``cli_errors``.
- Reachability is one TCP connect to each address in the client's ``server_url`` (the
  ``MODAL_SERVER_URL`` variable overrides it), all in parallel, bounded by ``timeout_s``
  including name resolution; none answering is :class:`~modal_rl.cli_errors.RunFailed`
  (exit 1). No TLS or RPC is attempted: the client does that right after.
"""

from __future__ import annotations

import socket
import threading
from urllib.parse import urlsplit

from modal_rl.cli_errors import RunFailed, UserError
from modal_rl.retry import wait_for

CONNECT_TIMEOUT_S = 1.5


# Where the Modal client finds credentials besides its config file (``MODAL_<KEY>`` variables).
CREDENTIAL_VARS = (
    "MODAL_TOKEN_ID",
    "MODAL_TOKEN_SECRET",
    "MODAL_OAUTH_REFRESH_TOKEN",
    "MODAL_OAUTH_CLIENT_ID",
)


# What a launcher offers instead of Modal; a command without these flags passes its own.
OFFLINE_HINT = "--backend local / --dry-run"  # sandboxes sweep: "--provider local"


def _no_credentials_message(path: str, offline_hint: str = OFFLINE_HINT) -> str:
    return (
        f"no Modal credentials: export MODAL_TOKEN_ID and MODAL_TOKEN_SECRET, or run `modal token new` "
        f"(writes {path}); or use {offline_hint} (no Modal account needed)"
    )


def credential_problem(offline_hint: str = OFFLINE_HINT) -> str | None:
    """Why the Modal client would refuse to start here, or None. No network."""
    import os

    # The common case first, without importing modal (~0.6 s): not in a container, no
    # credential variable and no config file where the client would look for one.
    path = os.environ.get("MODAL_CONFIG_PATH") or os.path.expanduser("~/.modal.toml")
    local = os.environ.get("MODAL_IS_REMOTE") != "1"
    if (
        local
        and not any(map(os.environ.get, (*CREDENTIAL_VARS, "MODAL_PROFILE")))
        and not os.path.exists(path)
    ):
        return _no_credentials_message(path, offline_hint)
    try:
        import modal.config as mc
    except Exception as exc:  # a broken ~/.modal.toml raises at import
        return (
            f"Modal's configuration could not be read ({' '.join(str(exc).split())[:200]}); fix or remove it"
        )
    import modal

    if not modal.is_local():  # inside a Modal container the client authenticates as the container
        return None
    cfg = mc.config
    token_id, token_secret = cfg.get("token_id"), cfg.get("token_secret")
    if cfg.get("oauth_refresh_token") or cfg.get("oauth_client_id"):
        return None  # OAuth credentials: the client checks their completeness itself
    if token_id and token_secret:
        return None
    path = mc.user_config_path
    profile = os.environ.get("MODAL_PROFILE")
    if profile and profile not in mc.config_profiles():
        return (
            f"Modal profile {profile!r} (MODAL_PROFILE) is not in {path}; run `modal profile list`, "
            f"or `modal token new --profile {profile}` to make it"
        )
    if token_id or token_secret:
        given, missing = (
            ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET") if token_id else ("MODAL_TOKEN_SECRET", "MODAL_TOKEN_ID")
        )
        return f"{given} is set but {missing} is not; set both (from `modal token new` or modal.com/settings/tokens)"
    return _no_credentials_message(path, offline_hint)


def server_addresses(server_url: str) -> list[tuple[str, int]]:
    """``(host, port)`` of each comma-separated URL the client would try."""
    out = []
    for url in (u.strip() for u in server_url.split(",")):
        if not url:
            continue
        parts = urlsplit(url if "://" in url else f"https://{url}")
        if parts.hostname:
            out.append((parts.hostname, parts.port or (80 if parts.scheme == "http" else 443)))
    return out


def _probe(host: str, port: int, results: dict, lock: threading.Lock) -> None:
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            outcome = "ok"
    except OSError as exc:
        outcome = type(exc).__name__ if not exc.strerror else exc.strerror.lower()
    with lock:
        results[(host, port)] = outcome


def reachability_problem(server_url: str, timeout_s: float = CONNECT_TIMEOUT_S) -> str | None:
    """None when any address of ``server_url`` accepts a TCP connection within ``timeout_s``."""
    addresses = server_addresses(server_url)
    if not addresses:
        return f"Modal server URL {server_url!r} names no host; fix MODAL_SERVER_URL or ~/.modal.toml"
    results: dict = {}
    lock = threading.Lock()
    for host, port in addresses:  # daemon threads: a DNS lookup that hangs cannot hold us
        threading.Thread(target=_probe, args=(host, port, results, lock), daemon=True).start()

    def settled() -> bool:
        with lock:
            return "ok" in results.values() or len(results) == len(addresses)

    wait_for(settled, timeout_s, poll_s=0.02)
    with lock:
        if "ok" in results.values():
            return None
        why = "; ".join(
            f"{host}:{port} {results.get((host, port), f'no answer in {timeout_s:g} s')}"
            for host, port in addresses
        )
    return f"cannot reach the Modal server ({why}); check the network (proxy, firewall) or MODAL_SERVER_URL"


def check_modal_access(timeout_s: float = CONNECT_TIMEOUT_S, offline_hint: str = OFFLINE_HINT) -> None:
    """Raise ``UserError`` (no credentials, exit 2) or ``RunFailed`` (no route, exit 1);
    ``offline_hint`` names the caller's own way to run without Modal."""
    problem = credential_problem(offline_hint)
    if problem:
        raise UserError(problem)
    import modal.config as mc

    if mc._is_remote():
        return
    problem = reachability_problem(str(mc.config.get("server_url")), timeout_s)
    if problem:
        raise RunFailed(problem)
