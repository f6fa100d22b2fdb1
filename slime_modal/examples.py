"""slime's example folders as a command line names them: which folder must be on PYTHONPATH,
which entry script the line is for, and servers the line expects on its own node.

slime's example scripts put their own folder on ``PYTHONPATH`` (``SCRIPT_DIR`` in their runtime
env) and name their modules bare: ``--rollout-function-path fully_async_rollout.generate_...``
(``examples/fully_async``, run with ``train_async.py``), ``--custom-generate-function-path
generate_with_retool.generate`` (``examples/retool``), ``generate_with_search.generate``
(``examples/search-r1``). Modules named ``examples.<folder>.<module>`` resolve from the slime
checkout, which is on ``PYTHONPATH`` already.

Invariant: reads the argv only; nothing is imported.
"""

from __future__ import annotations

import re
from urllib.parse import urlparse

from slime_modal.preflight import SlimeArgs

# Bare module -> its folder in the slime checkout (slime's examples/, as their scripts set it).
EXAMPLE_MODULES = {
    "fully_async_rollout": "examples/fully_async",
    "generate_with_retool": "examples/retool",
    "generate_with_search": "examples/search-r1",
}
# Modules whose examples run with slime's asynchronous entry script.
ASYNC_MODULES = ("fully_async_rollout",)
ASYNC_ENTRY = "train_async.py"
DEFAULT_ENTRY = "train.py"
# Flags whose value is a dotted Python path (module.function or module.Class).
_DOTTED_FLAG = re.compile(r"^--[a-z0-9-]+-path$")
# URL flags naming a server the job talks to (a teacher or reward model).
URL_FLAGS = ("--rm-url",)
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "0.0.0.0", "::1")


def dotted_modules(argv: list[str]) -> dict[str, str]:
    """``{top module: flag}`` for every dotted-path flag value of the line."""
    found: dict[str, str] = {}
    args = SlimeArgs(argv)
    for token in argv:
        flag = token.split("=", 1)[0]
        if not _DOTTED_FLAG.match(flag):
            continue
        for value in args.values(flag) or []:
            if "/" in value or "." not in value:
                continue  # a file path, or not a module.attribute
            found.setdefault(value.split(".", 1)[0], flag)
    return found


def example_dirs(argv: list[str], slime_path: str) -> list[str]:
    """Folders of slime's examples the line's modules live in, to go on PYTHONPATH."""
    return [f"{slime_path}/{EXAMPLE_MODULES[m]}" for m in dotted_modules(argv) if m in EXAMPLE_MODULES]


def entry_for(argv: list[str], given: str | None) -> tuple[str, str | None]:
    """``(entry script, note)``: the user's ``--entry``, else slime's async entry when the line
    names a fully-async rollout (with a one-line note), else ``train.py``."""
    modules = dotted_modules(argv)
    wants_async = next((m for m in ASYNC_MODULES if m in modules), None)
    if given is not None:
        return given, None
    if wants_async:
        return ASYNC_ENTRY, (
            f"{modules[wants_async]} {wants_async}... is slime's fully-async rollout: running "
            f"{ASYNC_ENTRY} (--entry {DEFAULT_ENTRY} to override)"
        )
    return DEFAULT_ENTRY, None


def split_script(argv: list[str], given: str | None) -> tuple[list[str], str | None]:
    """``(argv, entry)``: a line that starts as the script's own command (``python3 train.py
    ...``, ``train_async.py ...``) gives its script as the entry, and the rest is slime's argv.
    Raises ``ValueError`` when it disagrees with an explicit ``--entry``."""
    head = 0
    if argv and re.fullmatch(r"(.*/)?python[0-9.]*", argv[0]):
        head = 1
    if len(argv) > head and argv[head].endswith(".py") and not argv[head].startswith("-"):
        script = argv[head]
        if given is not None and given != script:
            raise ValueError(f"the line runs {script} but --entry says {given}: drop one of them")
        return argv[head + 1 :], script
    if head:
        raise ValueError(f"{argv[0]} {' '.join(argv[1:2])}: after -- give the script and its arguments")
    return list(argv), given


def loopback_servers(argv: list[str]) -> list[str]:
    """One line per server the line expects on the job's own node (a teacher at 127.0.0.1):
    on Modal nothing starts it there."""
    args = SlimeArgs(argv)
    problems = []
    for flag in URL_FLAGS:
        for value in args.values(flag) or []:
            host = urlparse(value).hostname or ""
            if host in LOOPBACK_HOSTS:
                problems.append(
                    f"{flag} {value}: the line expects a server on the job's own node (slime's example "
                    "scripts start the teacher there first); nothing starts it on Modal: serve it "
                    "elsewhere (e.g. its own Modal GPU function) and give that URL"
                )
    return problems
