"""Save and restore an env mid-episode, bit-exactly (for checkpoints and resume).

The state is a pair: ``arrays`` (name -> ndarray: the emulator or physics state, the frame stack) and
``meta`` (JSON-serialisable: counters, flags, generator positions, and the env id and options it belongs
to). The switchboard is *not* included: the caller saves and restores :class:`detrl.Sources` itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import gymnasium as gym
import numpy as np

from envs.core import SourcedEnv

#: Version of the state layout; bumped when keys change.
FORMAT = 1


def get_state(env: gym.Env) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Everything needed to continue ``env`` (made by :func:`envs.make`) bit-exactly from here.

    Returns ``(arrays, meta)``: ndarrays by name, and a JSON-serialisable dict.
    """
    inner = _sourced(env)
    arrays, meta = inner.state()
    return arrays, {"format": FORMAT, "env_id": inner.env_id, "options": dict(inner.options), **meta}


def set_state(env: gym.Env, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
    """Put ``env`` into the state :func:`get_state` returned, for an env made with the same id and options.

    The input is checked (keys, shapes, dtypes, types, env id, options); anything wrong raises a one-line
    ``ValueError`` and leaves ``env`` as it was.
    """
    inner = _sourced(env)
    if not isinstance(meta, Mapping) or not isinstance(arrays, Mapping):
        raise ValueError("invalid env state: arrays and meta must be mappings")
    if meta.get("format") != FORMAT:
        raise ValueError(f"invalid env state: format {meta.get('format')!r}, expected {FORMAT}")
    if meta.get("env_id") != inner.env_id:
        raise ValueError(f"invalid env state: it is for {meta.get('env_id')!r}, this env is {inner.env_id!r}")
    if meta.get("options") != inner.options:
        raise ValueError(
            f"invalid env state: made with options {meta.get('options')}, this env {inner.options}"
        )
    inner.load_state(arrays, meta)


def _sourced(env: gym.Env) -> SourcedEnv:
    """The detrl wrapper in ``env``'s wrapper chain (``env`` itself when it came from :func:`envs.make`)."""
    e: Any = env
    while not isinstance(e, SourcedEnv):
        if not isinstance(e, gym.Wrapper):
            raise TypeError(f"{env} was not made by envs.make")
        e = e.env
    return e
