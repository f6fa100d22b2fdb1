"""The CPU boundary of a slime run on a host without GPUs, in one place (``MODAL_RL_SLIME_CPU=1``).

slime's own ``train.py`` and ``train_async.py`` run unchanged on a CPU-only host with SGLang on
CPU and Megatron on CPU over gloo when four gaps are closed; each is closed here, and only in
that mode (``python -m slime_modal --cpu``, which the local main job uses):

- :mod:`.accelerator`: a ``cpu`` backend through slime's own ``register_accelerator``;
- :mod:`.torchvision_ops`: the PyPI torchvision is a CUDA build whose operators fail to load
  beside CPU torch, and its meta registrations then refuse to import (SGLang imports it);
- :mod:`.cuda_on_cpu`: Megatron calls ``torch.cuda`` directly (devices, streams, RNG, type
  names); installed in a process only when it first imports ``megatron``;
- :mod:`.layer_spec`: a layer spec, passed with slime's ``--spec``, that names parameters as
  TransformerEngine does (slime's converters expect those names) and attends over packed
  sequences with torch's SDPA (Megatron's CPU attention refuses them).

:mod:`.boot` is put on every process's ``PYTHONPATH`` in that mode; its ``sitecustomize`` runs
:func:`slime_modal.cpu.activate.install` at interpreter start.
"""
