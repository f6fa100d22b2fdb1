"""The SGLang package, for slime's rollout modules in the rollout-manager tests (one of the two
boundaries of ``tests/slime_adapter/test_slime_rollout_manager.py``; ``../sitecustomize.py`` is the other).

slime's ``slime.ray.rollout`` and ``slime.backends.sglang_utils.sglang_engine`` import three
SGLang modules at module level; SGLang's own (``sglang.srt.utils``, ``sglang.srt.server_args``)
need packages this project's environment does not have (the first missing: torchvision).
This package stands in for exactly the names slime imports, with SGLang's own values and field
names (checked against the SGLang 0.5.15.post1 wheel, the version slime's image
pins): nothing of slime is replaced. Nothing here launches or talks to a server: on the
external-engine path slime builds ``ServerArgs``' field list only, and never kills a process.
"""
