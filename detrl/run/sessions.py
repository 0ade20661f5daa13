"""The one path from a config to a :class:`~detrl.core.engine.Session`.

Every caller that records, replays or runs a config (the CLI, the auditor, the sweeps, the benchmarks,
the tests) goes through :func:`session_for`, so a config means one Session everywhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from detrl.core.engine import Session
from detrl.core.hardware import get_profile
from detrl.core.sources import Sources
from detrl.run.tasks import get


def session_for(
    cfg: Any,
    run_dir: str | Path | None,
    mode: str = "record",
    *,
    hardware: Any = None,
    data: Path | None = None,
    fingerprint: str | None = None,
    session_type: type[Session] = Session,
    **overrides: Any,
) -> Session:
    """The Session that records, replays or runs ``cfg`` without a bundle (``mode="off"``).

    ``hardware``: the profile to run on (default: the config's). ``data``: the training data's path where
    the task reads one. ``fingerprint``: the data fingerprint when the caller computed it already.
    ``session_type``: a :class:`Session` subclass to build (tests use one that keeps the initial weights).
    ``overrides``: further :class:`Session` arguments (``resume``, ``force``, ``caps``, ``sources``, ...;
    ``start`` and ``stop`` replay one segment between checkpoints).
    """
    task = get(cfg.task)
    if hardware is None:
        seed = getattr(cfg, "hardware_seed", None)
        hardware = cfg.hardware if seed is None else get_profile(cfg.hardware, seed=seed)
    if fingerprint is None and mode != "off":
        fingerprint = task.fingerprint(cfg, data)
    options: dict[str, Any] = {
        "precision": cfg.precision,
        "sources": Sources.from_config(cfg.sources),
        "hardware": hardware,
        "checkpoint_every": cfg.verify.checkpoint_every,
        "margin": cfg.verify.margin,
        "task": cfg.task,
        "config": cfg.model_dump(mode="json"),
        "planned_steps": task.planned_steps(cfg),
        "data_fingerprint": fingerprint,
        "ops_revision": task.ops_revision,
        **task.session_options(cfg),
        **overrides,
    }
    return session_type(run_dir, mode=mode, **options)
