"""Harnesses that attack detrl: the kill-and-resume crash harness (``crashtest``), the bundle and log
mutation fuzzer (``fuzzing``), hostile-bundle planting (``hostile``) and the log rewriter that forges a
consistent log (``logrewrite``).

Shipped in the package, not only in ``tests/``, because ``detrl bench crash|fuzz|hostile`` runs them on a
user's machine. Nothing below it imports it; only the benchmarks, the CLI's tests and ``tests/`` do.
"""
