"""The engine, knowing nothing of DQN or of particular models: the switchboard of random streams
(``sources``), hardware profiles (``hardware``), verifiable rounding (``rounding``, ``oprules``, ``kernel``,
``scale``, ``fused``, ``decompose``), calibration, precision and the :class:`~detrl.core.engine.Session`
that records or replays a training loop.

Imports only :mod:`detrl.formats`.
"""
