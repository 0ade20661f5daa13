"""Writing ``DIR/report/`` from ``DIR/summary.json``: the Markdown, the plots and the numbers, as one pure
function of the summary."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib import rc_context

from detrl.apps.report.markdown import _markdown
from detrl.apps.report.numbers import _number_rows, _numbers_csv
from detrl.apps.report.plots import _RC, PLOTS, _colours, _png, _Skip
from detrl.apps.report.vocabulary import MARKDOWN, NUMBER_COLUMNS, NUMBERS_CSV, NUMBERS_JSON, REPORT_DIR
from detrl.formats import safeio
from detrl.formats.summary import (
    load_summary,
)
from detrl.run.config import ConfigError


@dataclass(frozen=True)
class Report:
    """What :func:`make_report` wrote: the Markdown file, every file in ``report/``, the plots it skipped."""

    markdown: Path
    files: tuple[Path, ...]
    skipped: dict[str, str]  # plot file name -> why it was not drawn


def make_report(out: str | Path) -> Report:
    """Write ``out/report/`` from ``out/summary.json`` (see the module docstring); ConfigError if bad."""
    out = Path(out)
    s = load_summary(out)
    dest = out / REPORT_DIR
    _check_destination(dest)  # before anything is written: a refused report changes nothing on disk
    dest.mkdir(exist_ok=True)
    colours = _colours(list(s.rows))
    written: list[Path] = []
    plots: list[tuple[str, str, str | None, str]] = []
    skipped: dict[str, str] = {}
    # Extreme but valid numbers (1e-90 on a log axis) can make numpy warn inside matplotlib's tick
    # arithmetic; the plot is still right, and the warning would only be noise on the CLI's stderr.
    with rc_context(_RC), warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        for file, heading, build in PLOTS:
            try:
                fig, look = build(s, colours)
            except _Skip as e:
                skipped[file] = str(e)
                plots.append((file, heading, str(e), ""))
                stale = dest / file
                if stale.is_file() and not stale.is_symlink():  # an earlier report's plot no longer true
                    stale.unlink()
                continue
            safeio.write_atomic(dest, file, _png(fig))
            written.append(dest / file)
            plots.append((file, heading, None, look))
    numbers = _number_rows(s)
    safeio.write_atomic(dest, NUMBERS_CSV, _numbers_csv(numbers))
    doc = {"protocol": s.protocol, "columns": list(NUMBER_COLUMNS), "rows": numbers}
    safeio.write_atomic(dest, NUMBERS_JSON, safeio.dumps_json(doc))
    safeio.write_atomic(dest, MARKDOWN, _markdown(s, plots).encode())
    files = (dest / MARKDOWN, dest / NUMBERS_CSV, dest / NUMBERS_JSON, *written)
    return Report(dest / MARKDOWN, files, skipped)


def _check_destination(dest: Path) -> None:
    """Refuse (ConfigError, one line) a ``report/`` that is a symbolic link or not a directory, and in it any
    entry the report writes or deletes (its files and :func:`safeio.write_atomic`'s temporary files) that
    is a link or not a regular file: the sweep directory comes from another party, and nothing is written
    or deleted through a link that leads out of it."""
    own = "the report is written only into a directory of the sweep's own; nothing was changed"
    if dest.is_symlink():
        raise ConfigError(f"{dest}: is a symbolic link; {own}")
    if not os.path.lexists(dest):
        return
    if not dest.is_dir():
        raise ConfigError(f"{dest}: exists and is not a directory; {own}")
    mine = "the report replaces only regular files of its own; nothing was changed"
    for name in (MARKDOWN, NUMBERS_CSV, NUMBERS_JSON, *(file for file, _, _ in PLOTS)):
        for entry in (dest / name, dest / f".{name}.tmp"):
            if entry.is_symlink():
                raise ConfigError(f"{entry}: is a symbolic link; {mine}")
            if os.path.lexists(entry) and not entry.is_file():
                raise ConfigError(f"{entry}: is not a regular file; {mine}")


def write_report(out: str | Path) -> Path:
    """Turn the ablation sweep directory ``out`` into ``out/report/report.md`` with its plots and numbers.

    Returns the path of ``report.md``. Raises :class:`~detrl.run.config.ConfigError` (one line) when ``out`` has
    no ``summary.json`` or it is malformed, or when ``report/`` or a file in it is a link (nothing is changed).
    """
    return make_report(out).markdown
