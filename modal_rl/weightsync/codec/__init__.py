"""Encoding and decoding: the codec config and encoders (``encode``), the verified decoder
(``decode``), the diff kernels, scatter, worker threads, warm-up, measured decode costs, and
the chunk codings (``codings``).
"""
