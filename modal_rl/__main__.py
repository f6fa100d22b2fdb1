"""``python -m modal_rl``: the ``modal-rl`` command (:mod:`modal_rl.cli.main`)."""

from modal_rl.cli.main import entry

entry()
