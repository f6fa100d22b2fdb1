"""Runs at the start of every interpreter of a CPU-mode slime job (this directory is on its
``PYTHONPATH``): Ray workers, SGLang's server processes and the driver all get the boundary."""

import os

if os.environ.get("MODAL_RL_SLIME_CPU") == "1":
    from slime_modal.cpu.activate import install

    install()
