"""What a user runs: the auditor (``audit``), ablation sweeps (``ablation``), the replication table
(``replication``), the distances between trained models (``metrics``) and the sweep report (``report``).

Each app imports the layers below it (run, core, formats, supervised) and no other app, so each can be read
alone.
"""
