"""The one dependency of slime's rollout modules replaced in the rollout-manager tests.

slime's ``slime.ray.rollout`` and ``slime.backends.sglang_utils.sglang_engine`` import three
SGLang modules at module level; SGLang's own (``sglang.srt.utils``, ``sglang.srt.server_args``)
need GPU-side packages (torchvision, triton, ...) that this project's environment does not
have. This package stands in for exactly the names slime imports, with SGLang's own values
and field names (checked against the SGLang 0.5.15.post1 wheel, the version slime's image
pins): nothing of slime is replaced. Nothing here launches or talks to a server: on the
external-engine path slime builds ``ServerArgs``' field list only, and never kills a process.
"""
