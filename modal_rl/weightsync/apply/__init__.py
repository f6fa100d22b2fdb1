"""Applying versions to inference engines: the engine map learned from the engine's own
loader, in-place activation, the vLLM and SGLang worker hooks that run inside a server, and the
LoRA staging names. What asks a server to pull (over HTTP) is the engine side's
(``modal_rl.engines.vllm_push``).
"""
