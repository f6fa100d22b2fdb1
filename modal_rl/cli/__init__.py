"""``modal-rl``: one command over the project's launchers and tools (:mod:`modal_rl.cli.main`)."""
