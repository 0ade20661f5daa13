"""The benchmark registry: detrl's own register with ``@benchmark(name, description)``; other packages
contribute through the ``detrl.benchmarks`` entry-point group (see :mod:`detrl.bench`).

The registry names detrl's own families (:data:`FAMILIES`) and imports them on first use, as the task
registry does its built-in task: so ``detrl bench`` reaches a benchmark without the registry, or the CLI
above it, importing the engine, and each family sits directly on the layers it measures."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points

#: A benchmark: takes its command-line options, returns the exit code.
BenchFn = Callable[[list[str]], int]
#: Entry-point group through which other packages contribute benchmarks (see the module docstring).
ENTRY_POINT_GROUP = "detrl.benchmarks"
#: Benchmark name -> (one-line description, callable). detrl's own are registered with :func:`benchmark`
#: at import; the entry points' are added on first use by :func:`benchmarks` or :func:`main`.
BENCHMARKS: dict[str, tuple[str, BenchFn]] = {}
#: detrl's own benchmark families: each registers its benchmarks with :func:`benchmark` when imported.
FAMILIES = ("detrl.bench.performance", "detrl.bench.perop", "detrl.bench.trust")


def benchmark(name: str, description: str) -> Callable[[BenchFn], BenchFn]:
    """Decorator: register ``fn(rest) -> exit code`` as benchmark ``name``; a name taken twice is refused."""

    def register(fn: BenchFn) -> BenchFn:
        if name in BENCHMARKS:
            raise ValueError(f"benchmark {name!r} is registered twice")
        BENCHMARKS[name] = (description, fn)
        return fn

    return register


def _load_families() -> None:
    """Import detrl's own families (once: a module imports once, and registers as it does)."""
    for module in FAMILIES:
        importlib.import_module(module)


_entry_points_loaded = False


def _load_entry_points() -> None:
    """Register the benchmarks of the ``detrl.benchmarks`` entry-point group (imported once, on demand)."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            value = ep.load()
        except Exception as e:  # noqa: BLE001 - a broken plugin is one line, not a traceback
            raise ValueError(
                f"benchmark {ep.name!r} ({ep.value}) failed to load: {type(e).__name__}: {e}"
            ) from e
        if not (
            isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str) and callable(value[1])
        ):
            raise ValueError(
                f"benchmark {ep.name!r} ({ep.value}): an entry point of {ENTRY_POINT_GROUP} must name a "
                "(description, callable) pair"
            )
        if ep.name in BENCHMARKS:
            raise ValueError(f"benchmark {ep.name!r} ({ep.value}) is registered twice")
        benchmark(ep.name, value[0])(value[1])


def benchmarks() -> dict[str, tuple[str, BenchFn]]:
    """Every benchmark, name -> (description, callable): detrl's own, then the entry points' (sorted)."""
    _load_families()
    _load_entry_points()
    return dict(BENCHMARKS)


def describe() -> str:
    """One line per benchmark, ``name  description``, for ``detrl bench --help``."""
    known = benchmarks()
    width = max(len(n) for n in known)
    return "\n".join(f"  {name:<{width}}  {desc}" for name, (desc, _) in known.items())


def main(name: str, rest: list[str]) -> int:
    """Run benchmark ``name`` with command-line options ``rest``; returns the exit code."""
    _load_families()
    if name not in BENCHMARKS:  # detrl's own run without importing any plugin
        _load_entry_points()
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
    return BENCHMARKS[name][1](list(rest))
