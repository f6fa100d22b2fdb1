"""A run's numbers: the ``modal_rl/`` per-step metrics (:mod:`.numbers`) and the static HTML
run report (``python -m modal_rl.report RUN_DIR``, :mod:`.page`)."""
