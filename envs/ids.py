"""Which environment ids detrl supports, checked cheaply (no emulator is built, no ROM is loaded, no MinAtar
import)."""

from __future__ import annotations

import functools
import re

#: Classic-control ids, each with the length of its unwrapped ``state`` vector (what :mod:`envs.state`
#: saves and checks).
CLASSIC_CONTROL: dict[str, int] = {"CartPole-v1": 4, "Acrobot-v1": 4, "MountainCar-v0": 2}

#: MinAtar ids (Young & Tian 2019), each with its game module in ``minatar.environments``. ``-v1`` means the
#: game's minimal action set, as in minatar's own gymnasium registration.
MINATAR: dict[str, str] = {
    "MinAtar/Asterix-v1": "asterix",
    "MinAtar/Breakout-v1": "breakout",
    "MinAtar/Freeway-v1": "freeway",
    "MinAtar/Seaquest-v1": "seaquest",
    "MinAtar/SpaceInvaders-v1": "space_invaders",
}

_ALE_ID = re.compile(r"ALE/(\w+)-v5")
_SUPPORTED = ", ".join(CLASSIC_CONTROL) + ", ALE/<Game>-v5 (e.g. ALE/Breakout-v5), " + ", ".join(MINATAR)


def is_atari(env_id: str) -> bool:
    """True for ids of the form ``ALE/<Game>-v5`` (whether the game exists is :func:`check_env_id`'s job)."""
    return _ALE_ID.fullmatch(env_id) is not None


def is_minatar(env_id: str) -> bool:
    """True for the ids of :data:`MINATAR`, e.g. ``MinAtar/Breakout-v1``."""
    return env_id in MINATAR


def check_env_id(env_id: str) -> None:
    """Raise ``ValueError`` (one line) unless ``env_id`` is a supported classic-control id, an ALE game or a
    MinAtar game."""
    if env_id in CLASSIC_CONTROL or env_id in MINATAR:
        return
    m = _ALE_ID.fullmatch(env_id)
    if m is not None and m.group(1) in _ale_games():
        return
    raise ValueError(f"unknown env id {env_id!r}; supported: {_SUPPORTED}")


def ale_rom(env_id: str) -> str:
    """The ale-py ROM id (snake_case, e.g. ``"space_invaders"``) of ``ALE/<Game>-v5``."""
    check_env_id(env_id)
    m = _ALE_ID.fullmatch(env_id)
    if m is None:
        raise ValueError(f"{env_id!r} is not an Atari id")
    return _ale_games()[m.group(1)]


def minatar_game(env_id: str) -> str:
    """The minatar game module (e.g. ``"space_invaders"``) of ``MinAtar/<Game>-v1``."""
    check_env_id(env_id)
    if env_id not in MINATAR:
        raise ValueError(f"{env_id!r} is not a MinAtar id")
    return MINATAR[env_id]


@functools.lru_cache(maxsize=1)
def _ale_games() -> dict[str, str]:
    """``{"SpaceInvaders": "space_invaders", ...}`` from ale-py's bundled ROM list (a JSON file, no ROM read)."""
    from ale_py import roms  # lazy: classic-control users never pay for importing the emulator
    from ale_py.registration import rom_id_to_name

    return {rom_id_to_name(rom): rom for rom in roms.get_all_rom_ids()}
