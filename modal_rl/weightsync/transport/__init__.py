"""Transports: the ports (``base``: ``FrameSink``/``FrameSource``), TCP (``tcp`` server,
``transport.tcp_source`` receiver, admission, hello lines, retention) and stores (``store``, ``lease``,
``volumes``).
"""
