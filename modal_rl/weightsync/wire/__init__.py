"""The wire format: frames and their records, keys and MACs, epochs, dtype codes, chunk
headers, and the bounded reader of a stored frame file. No codec: importing it loads no numba.
"""
