"""Chunk codings: dense XOR, sparse v1 (``chunks``) and context-modelled v2 (``chunks_v2``,
with its rANS and residual models).
"""
