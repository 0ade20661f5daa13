"""Ctrl-C while the local workers' parent imports: it ends at once and quietly; the ``detrl`` process reports.

Imported first by the process local workers fork from (:func:`detrl.run.executors.prestart`), and by nothing
else. A terminal's Ctrl-C reaches every process of its group: the ``detrl`` parent, the fork server and the
workers. The fork server ignores SIGINT once it has imported what it preloads, but a Ctrl-C during those
imports (seconds of torch) would print a traceback from it; the parent alone prints ``detrl: interrupted``
and exits 130. A worker keeps Python's own behaviour (KeyboardInterrupt in its job, which the pool hands
to the parent), as it had when spawned: ending it abruptly instead leaves the pool broken under futures the
parent has just cancelled, and concurrent.futures prints a traceback of its own.
"""

from __future__ import annotations

import os
import signal

_SERVER = os.getpid()  # the fork server: this module is imported there, and its workers inherit it


def _on_ctrl_c(signum: int, frame: object) -> None:
    if os.getpid() == _SERVER:
        os._exit(128 + signum)
    raise KeyboardInterrupt


# The fork server keeps this handler while it imports; once ready it ignores SIGINT itself and gives each
# worker it forks the handler it found, this one.
signal.signal(signal.SIGINT, _on_ctrl_c)
