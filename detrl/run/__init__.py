"""Running an experiment: configs (``config``), tasks found by registration and the one path from a config
to a Session (``tasks``), process-pool and Ray executors (``executors``), shared experiment machinery
(``traced``: a Session that keeps each step's state) and text formatting for people (``fmt``).

Imports :mod:`detrl.core` and :mod:`detrl.formats`; ``detrl.supervised``, ``agents`` and ``envs`` build on it.
"""
