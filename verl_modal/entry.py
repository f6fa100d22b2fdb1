"""Which verl main a command line runs, and with which config: the line as an example script
writes it, after ``--``.

Accepted forms (the rest of the line is Hydra overrides):

- ``key=value ...``: verl's PPO main (``verl.trainer.main_ppo``, config ``ppo_trainer``);
- ``--config-path=DIR --config-name=NAME ...`` (or ``-cp``/``-cn``, ``NAME.yaml``): that config,
  e.g. ``ppo_megatron_trainer``; ``DIR`` is relative to the main's own file, as Hydra reads it;
- ``python3 -m MODULE ...`` / ``-m MODULE ...``: another of verl's mains, e.g.
  ``verl.experimental.fully_async_policy.fully_async_main`` or the one-step-off-policy main.

On a cluster, verl's PPO main runs through our driver (``verl_modal.launch``) and another main
runs as itself (``python -m MODULE`` with the line's config flags), the way ``ray job submit``
would run it. A one-node local run takes any main that hands its TaskRunner class to verl's
``run_ppo`` (``VerlEntry.via_run_ppo``; ``verl_modal.runner.run_main``) in-process.
Invariant: nothing is imported to find a main (its file is read as text).
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass, field

MAIN_PPO = "verl.trainer.main_ppo"
_HYDRA_MAIN = re.compile(r"@hydra\.main\(([^)]*)\)")
_KWARG = re.compile(r"""(config_path|config_name)\s*=\s*["']([^"']+)["']""")
_RUN_PPO_CALL = re.compile(r"\brun_ppo\(\s*config\s*,\s*task_runner_class\s*=")


class EntryError(ValueError):
    """A line whose main or config cannot be found; the message is one line."""


@dataclass
class VerlEntry:
    module: str = MAIN_PPO
    config_dir: str = ""  # absolute, on this machine
    config_name: str = "ppo_trainer"
    config_args: list[str] = field(default_factory=list)  # the line's own config flags, verbatim
    overrides: list[str] = field(default_factory=list)
    via_run_ppo: bool = True  # the main calls run_ppo(config, task_runner_class=...)

    @property
    def ours(self) -> bool:
        """Whether our driver runs it (verl's PPO main); else the main runs as itself."""
        return self.module == MAIN_PPO


def _module_file(module: str) -> str:
    top, _, rest = module.partition(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        hint = "; install it with: pip install 'modal-rl[verl]'" if top == "verl" else ""
        raise EntryError(f"-m {module}: {top} is not installed here{hint}")
    base = os.path.join(list(spec.submodule_search_locations)[0], *rest.split(".")) if rest else ""
    for candidate in (base + ".py", os.path.join(base, "__main__.py")):
        if rest and os.path.isfile(candidate):
            return candidate
    raise EntryError(f"-m {module}: no such module in the installed {top}")


def hydra_defaults(path: str) -> tuple[str, str]:
    """``(config_path, config_name)`` of the ``@hydra.main`` in the file at ``path``."""
    with open(path, encoding="utf-8") as f:
        found = _HYDRA_MAIN.search(f.read())
    if not found:
        raise EntryError(f"{path} has no @hydra.main: not a verl main")
    values = dict(_KWARG.findall(found.group(1)))
    return values.get("config_path", "config"), values.get("config_name", "ppo_trainer")


def _take(tokens: list[str], i: int, flag: str) -> tuple[str, int]:
    token = tokens[i]
    if "=" in token and token.startswith("--"):
        return token.split("=", 1)[1], i + 1
    if i + 1 >= len(tokens):
        raise EntryError(f"{flag} needs a value")
    return tokens[i + 1], i + 2


def parse(argv: list[str]) -> VerlEntry:
    """The line's main, config and overrides (see the module doc)."""
    tokens = list(argv)
    entry = VerlEntry()
    i = 0
    if tokens and re.fullmatch(r"(.*/)?python[0-9.]*", tokens[0]):
        i = 1
    if i < len(tokens) and tokens[i] == "-m":
        if i + 1 >= len(tokens):
            raise EntryError("-m needs a module, e.g. -m verl.trainer.main_ppo")
        entry.module, i = tokens[i + 1], i + 2
    elif i == 1:
        raise EntryError(f"{tokens[0]} {' '.join(tokens[1:2])}: give the main as python3 -m MODULE")
    path_arg = name_arg = None
    while i < len(tokens):
        token = tokens[i]
        if token in ("--config-path", "-cp") or token.startswith("--config-path="):
            start = i
            path_arg, i = _take(tokens, i, "--config-path")
            entry.config_args += tokens[start:i]
        elif token in ("--config-name", "-cn") or token.startswith("--config-name="):
            start = i
            name_arg, i = _take(tokens, i, "--config-name")
            entry.config_args += tokens[start:i]
        elif token.startswith("-") and "=" not in token.split("=", 1)[0][:2]:
            raise EntryError(
                f"{token!r} is neither a Hydra override (key=value) nor --config-path/--config-name; "
                "write the main as python3 -m MODULE before the overrides"
            )
        else:
            entry.overrides.append(token)
            i += 1
    if not entry.module.startswith("verl."):
        raise EntryError(
            f"-m {entry.module}: the image holds verl and modal-rl only; run one of verl's mains "
            f"(e.g. {MAIN_PPO}), or build an image with your code (--image)"
        )
    main_file = _module_file(entry.module)
    default_path, default_name = hydra_defaults(main_file)
    with open(main_file, encoding="utf-8") as f:
        entry.via_run_ppo = entry.ours or bool(_RUN_PPO_CALL.search(f.read()))
    config_path = path_arg or default_path
    if not os.path.isabs(config_path):
        config_path = os.path.normpath(os.path.join(os.path.dirname(main_file), config_path))
    name = (name_arg or default_name).strip("'\"")
    entry.config_name = name[:-5] if name.endswith(".yaml") else name
    entry.config_dir = config_path
    own = os.path.normpath(os.path.join(os.path.dirname(main_file), default_path))
    if entry.ours and config_path != own:
        raise EntryError(
            f"--config-path {path_arg}: the image holds verl's own configs ({own} here); name one of "
            "them with --config-name, or put yours on a Volume and pass --image with it"
        )
    if not os.path.isfile(os.path.join(config_path, entry.config_name + ".yaml")):
        raise EntryError(
            f"--config-name {entry.config_name}: no {entry.config_name}.yaml in {config_path} "
            f"(--config-path is relative to {os.path.basename(main_file)}'s folder)"
        )
    return entry
