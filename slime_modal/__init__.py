"""slime adapter: runs an unchanged slime job on a modal_rl cluster (``python -m slime_modal``)."""
