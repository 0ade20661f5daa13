"""Every byte detrl puts on disk, and the one reader of each: the rounding log (``roundlog``), the run
bundle (``bundle``), state commitments and Merkle trees (``commit``), Merkle inclusion proofs (``proof``),
bounded reads and atomic writes (``safeio``), and the ``summary.json`` of an ablation sweep (``summary``).

The lowest layer: it imports no other part of detrl, so a format is read the same way by the trainer, the
auditor and the test harnesses that forge it.
"""
