"""Tasks: what ``detrl train`` records and ``detrl audit`` replays, found by registration.

A task is a :class:`Task` value: its config schema, its train loop and how it sets up a Session. detrl
ships the ``supervised`` task; other packages contribute tasks through the entry-point group
``detrl.tasks`` (``agents`` contributes ``dqn``), so detrl never imports them by name and layers point
one way. The registry imports no engine, so :mod:`detrl.run.config` can find a task's schema here without
pulling in the engine; :mod:`detrl.run.sessions` turns a config into a Session.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from pydantic import BaseModel

ENTRY_POINT_GROUP = "detrl.tasks"
#: Tasks that ship with detrl itself: name -> "module:attribute" (imported on first use).
_BUILTIN = {"supervised": "detrl.supervised.train:TASK"}


@dataclasses.dataclass(frozen=True)
class Task:
    """A kind of run detrl can record and audit.

    Attributes:
        name: the config's ``task`` value.
        config: the pydantic schema of its configs (a :class:`~detrl.run.config.RunBase` subclass; this module
            does not import :mod:`detrl.run.config`, which finds schemas here: no import circle).
        run: ``run(cfg, session, progress=False, writer=None) -> metrics``: the train loop, recording,
            replaying or off. It must stop after a whole step once ``session.stop_requested`` is set, and
            call ``session.restore()`` after building its state so ``--resume`` continues.
        planned_steps: the session steps the config plans (the total a stopped run resumes to).
        fingerprint: ``fingerprint(cfg, data)``: SHA-256 hex of the training data (None when the task
            generates its data). ``data`` is the path the auditor supplies, or None for the default data.
        session_options: extra :class:`Session` arguments for a config (calibration steps, random-op
            routing).
        resume_keys: config keys that ``detrl train --resume --set`` may change: only those that leave the
            steps already recorded as they were (so the resumed bundle still replays from one config).
        caps: the auditor's default bounds on config values read from a bundle (dotted key -> maximum;
            lists are bounded element by element), so a bundle cannot make the auditor allocate or run
            without limit. ``detrl audit --cap KEY=VALUE`` overrides them. Keys ``size.NAME`` bound the
            totals that ``size`` reports.
        size: ``size(cfg) -> {name: amount}``: what the run will allocate, computed without allocating it
            (parameters counted on torch's meta device, data and buffer bytes from shapes), so values that
            are each within their caps cannot multiply into a giant run.
        inputs: ``inputs(cfg) -> {name: why}``: the files the auditor must supply for this config, by the
            name of the ``audit`` argument that carries each (``data``, ``init_from``; ``detrl audit --data``,
            ``--init-from``), with the reason shown when one is missing. A bundle never names a file the
            auditor opens; ``fingerprint`` and ``run`` receive each supplied one as a keyword argument.
        ops_revision: the op-sequence revision ``run`` records. A verifiable bundle's rounding log is keyed
            by the position of each rounded op in its step, so a change to the ops a step dispatches (their
            kind, order or number) raises it, and ``run`` keeps the older path for bundles of an older
            revision (``session.ops_revision`` says which). Bundles record it; an auditor refuses a higher one.
    """

    name: str
    config: type[BaseModel]
    run: Callable[..., dict[str, Any]]
    planned_steps: Callable[[Any], int]
    fingerprint: Callable[[Any, Path | None], str | None]
    session_options: Callable[[Any], dict[str, Any]] = lambda cfg: {}
    resume_keys: frozenset[str] = frozenset()
    caps: Mapping[str, float] = dataclasses.field(default_factory=dict)
    size: Callable[[Any], dict[str, int]] = lambda cfg: {}
    inputs: Callable[[Any], dict[str, str]] = lambda cfg: {}
    ops_revision: int = 1


#: Default caps on the totals ``Task.size`` reports (``detrl audit --cap size.params=N`` raises one).
SIZE_CAPS = {"size.params": 300_000_000, "size.data_bytes": 4 << 30}


_REGISTRY: dict[str, Task] = {}


def register(task: Task) -> Task:
    """Add ``task`` to the registry (a second task of the same name is refused)."""
    if task.name in _REGISTRY and _REGISTRY[task.name] is not task:
        raise ValueError(f"a task named {task.name!r} is already registered")
    _REGISTRY[task.name] = task
    return task


def _discovered() -> dict[str, str]:
    found = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return {**found, **_BUILTIN}


def names() -> list[str]:
    """Every task name known here: registered, built in, or offered by an installed package."""
    return sorted({*_REGISTRY, *_discovered()})


class UnknownTask(ValueError):
    """No task of that name is registered, built in or installed."""


def get(name: str) -> Task:
    """The task called ``name``. Raises :class:`UnknownTask` (one line) for an unknown one."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    target = _discovered().get(name)
    if target is None:
        raise UnknownTask(f"config error: task: unknown task {name!r}; known: {', '.join(names())}")
    module, _, attr = target.partition(":")
    task = getattr(importlib.import_module(module), attr)
    if not isinstance(task, Task) or task.name != name:
        raise UnknownTask(f"config error: task: {target} is not a detrl Task named {name!r}")
    return register(task)
