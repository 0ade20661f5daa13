"""Gymnasium environments under the detrl switchboard.

Every random decision (initial states, sticky actions, no-op starts) draws from a named stream of a
:class:`detrl.Sources` (``env``, ``sticky``, ``noop``), and an env's whole state can be saved and restored
mid-episode. ``envs`` imports ``detrl``; ``detrl`` never imports ``envs``.
"""

from envs.ids import check_env_id, is_atari, is_minatar
from envs.make import make
from envs.state import get_state, set_state

__all__ = ["check_env_id", "get_state", "is_atari", "is_minatar", "make", "set_state"]
