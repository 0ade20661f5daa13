"""Production-path fuzzing (``detrl bench fuzz --path audit``): consistently forged bundles audited by
forks of the real command end in a documented verdict, never an internal error, a signal or a hang.

The benchmark runs in a fresh process: a fork must not inherit a torch thread pool, and this test
process has run torch already. ``detrl bench fuzz --path audit --cases 100000`` is the full run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_forged_bundles_audited_by_the_real_command_never_crash() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "detrl.cli",
            "bench",
            "fuzz",
            "--path",
            "audit",
            "--cases",
            "40",
            "--seed",
            "7",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "crashes (exit 70, other codes, signals, tracebacks, timeouts): 0 (0 distinct)" in proc.stdout
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines() if line.split()[:1]}
    for kind in ("log", "commitments", "manifest", "checkpoint", "bytes"):
        assert int(rows[kind][0]) > 0, proc.stdout  # every kind of forgery was tried
    # forged commitments and checkpoints (a flipped hash bit, a changed tensor) diverge far more often
    # than they replicate: the replay compares them
    assert int(rows["commitments"][2]) > int(rows["commitments"][1]), proc.stdout
