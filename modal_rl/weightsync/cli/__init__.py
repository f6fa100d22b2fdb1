"""``python -m modal_rl.weightsync``: the encode/apply/inspect/receive commands."""
