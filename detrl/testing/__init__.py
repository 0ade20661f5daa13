"""Harnesses that attack detrl: the kill-and-resume crash harness (``crashtest``), the bundle and log
mutation fuzzer (``fuzzing``), the production-path fuzzer that forges bundles consistently and forks the
real ``detrl audit`` per case (``auditfuzz``), hostile-bundle planting (``hostile``) and the log rewriter
that forges a consistent log (``logrewrite``).

Shipped in the package, not only in ``tests/``, because ``detrl bench crash|fuzz|hostile`` runs them on a
user's machine. Nothing below it imports it; only the benchmarks, the CLI's tests and ``tests/`` do.
"""
