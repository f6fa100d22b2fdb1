"""Asynchronous RL, framework-neutral: which policy version made each token
(``versions``), how far behind the trainer a sample may start (``pacing``), and engines
that take a new version between tokens (``engine_client``, ``kv_policy``).

The package is ``asyncrl`` because ``async`` is a Python keyword."""
