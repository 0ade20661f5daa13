"""The installed ``detrl`` program, as the harnesses that drive detrl from outside reach it."""

from __future__ import annotations

from collections.abc import Callable


def detrl_program() -> Callable[[list[str]], int]:
    """The installed ``detrl`` program's entry point (its console script in pyproject.toml).

    The harness drives detrl as a user does, by its command line, so it names the program, not the module:
    the CLI stays on top of every layer, and nothing in the package imports it.
    """
    from importlib.metadata import entry_points

    (script,) = entry_points(group="console_scripts", name="detrl")
    return script.load()
