"""verl adapter: runs an unchanged verl job on a modal_rl cluster (``python -m verl_modal``)."""
