"""Applying versions to inference engines: the engine map learned from the engine's own
loader, in-place activation, vLLM and SGLang hooks, and the pusher that drives engine pulls.
"""
