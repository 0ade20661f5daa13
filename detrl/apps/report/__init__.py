"""``detrl report DIR``: an ablation sweep (``detrl ablate``) as a Markdown report, PNG plots, CSV and JSON.

The report reads only ``DIR/summary.json`` (the runs themselves are not needed) and writes ``DIR/report/``:

* ``report.md``: provenance (command, configs, machine), whether the control was bitwise identical, findings
  computed from the numbers, the main table (and, for the supervised protocol, the remedies), the plots with
  one sentence each on what to look for, and the references;
* ``learning_curves.png``, ``metrics.png``, ``divergence.png``, ``instability.png``, ``distance.png``: a plot
  whose data the summary lacks is skipped, and the report says why;
* ``numbers.csv`` and ``numbers.json``: every number of the tables, long format
  ``table, condition, metric, value, lo, hi, unit``, in the summary's own units (fractions, not percent).

Everything is a pure function of ``summary.json``: no date, path of DIR or software version is written, and
the PNGs carry no ``Software`` tag, so regenerating from the same file gives the same bytes (with the same
matplotlib). ``summary.json`` is treated as untrusted: read without following a link, at most
:data:`detrl.formats.summary.MAX_SUMMARY_BYTES`, strict JSON, every field type-checked and size-bounded; any defect is one
:class:`~detrl.formats.summary.SummaryError` line (its reader is :mod:`detrl.formats.summary`).
"""

from __future__ import annotations

from detrl.apps.report.plots import PLOTS
from detrl.apps.report.vocabulary import NUMBER_COLUMNS
from detrl.apps.report.write import Report, make_report, write_report
from detrl.formats.summary import Summary, load_summary

__all__ = ["NUMBER_COLUMNS", "PLOTS", "Report", "Summary", "load_summary", "make_report", "write_report"]
