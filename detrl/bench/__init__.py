"""Benchmarks behind BENCHMARKS.md: ``detrl bench NAME [options]``; ``detrl bench --help`` lists them all.

Every benchmark prints a header line naming the machine and a small table to stdout; progress goes to
stderr. Ratios are always measured side by side in one run (variants interleaved, repeated, medians),
because a shared CPU is noisy. detrl's own:

``overhead``     step time and peak memory of verifiable precision against plain FP64 and FP32; each
                 (model, variant, repeat) in a fresh subprocess, so that its peak RSS is its own
``roundlog``     rounding-log bytes per step against the dense encoding and the paper's 26.2 MB a step
``nolog``        a verifiable run replayed on every emulated profile with its log and with it emptied
``replication``  the paper's experiment: FP32, FP64 rounded without the log, verifiable, per profile
``fuzz``         mutation-fuzz the bundle readers (:mod:`detrl.testing.fuzzing`), or with ``--path audit``
                 forged bundles through the real ``detrl audit`` (:mod:`detrl.testing.auditfuzz`)
``fsync``        the cost of the durable points as a share of run time
``sweep``        ablation sweep throughput, 1 worker against N
``hostile``      audit hostile bundles (:mod:`detrl.testing.hostile`): exit code, time, peak RSS

Contributed through the entry points below: ``crash`` (:mod:`detrl.testing.crashtest`, kill and resume)
and ``dqn`` (:mod:`agents.bench`, detrl's DQN against Stable-Baselines3).

The registry :data:`BENCHMARKS` maps a name to ``(one-line description, callable(rest) -> exit code)``.
detrl's own benchmarks register with ``@benchmark(name, description)``; other packages contribute theirs
through the entry-point group ``detrl.benchmarks``, whose every entry point names a module attribute that
is such a ``(description, callable)`` pair, e.g. in ``pyproject.toml``::

    [project.entry-points."detrl.benchmarks"]
    dqn = "agents.bench:BENCHMARK"

They are imported only when needed (an unknown name, ``detrl bench --help``), so detrl never imports
``agents`` by name and running one of detrl's own benchmarks imports no plugin. A name registered twice
is refused.
"""

from __future__ import annotations

from detrl.bench.registry import BENCHMARKS, BenchFn, benchmark, benchmarks, describe, main

__all__ = ["BENCHMARKS", "BenchFn", "benchmark", "benchmarks", "describe", "main"]
