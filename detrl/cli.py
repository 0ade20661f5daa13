"""``detrl train | audit | prove | verify-proof | dispute | ablate | report | profiles | bench``.

Exit codes: 0 success (audit: replicated), 1 diverged (verify-proof: does not verify; dispute: settled), 2
bad input (config, bundle, proof, arguments, a bundle another process writes), 3 incomplete recording, 4 log
incomplete, 130 interrupted (Ctrl-C). Every error a user can cause is one line on stderr, never a traceback (set
DETRL_DEBUG=1 to see one); 70 is left for a bug in detrl itself. The module imports only the standard
library, so even a Ctrl-C during start-up is one line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from detrl.run.fmt import format_bytes

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
EXIT_INTERNAL = 70
AUDIT_EPILOG = """exit codes (verdicts):
  0  replicated      every durable commitment matched and the rounding log kept its thresholds
  1  diverged        a commitment differs: the step, whether the data differed, the decisive anomaly
  2  bad input       a malformed bundle, one beyond the auditor's caps, a script bundle, missing --data
                     or --init-from
  3  incomplete      the recording did not finish (killed or still running): its durable prefix matched
  4  log incomplete  the log omits near-midpoint elements within its own thresholds, or has refused entries
"""
DISPUTE_EPILOG = """exit codes:
  0  no dispute      both bundles commit to the same leaves (equal Merkle roots)
  1  settled         the first differing step, the bundle the referee reproduces and the op it blames
  2  bad input       a malformed bundle, two bundles of different configs or lengths, a party whose
                     answers do not hash to its own root
"""
VERIFY_PROOF_EPILOG = """exit codes:
  0  verified        the step's leaf and the last leaf hash up to the root (--root, else the proof's own)
  1  not verified    one line: which hash differs, or that the proof is for another root
  2  bad input       a malformed proof file (one line naming the problem), or a malformed --root
"""


def _resume_config(run_dir: Path, overrides: list[str]) -> Any:
    """The config a ``--resume`` continues: the bundle's own, with only the ``--set`` keys its task allows."""
    from detrl.formats import bundle as bundle_mod
    from detrl.formats import safeio
    from detrl.run import config as config_mod
    from detrl.run import tasks

    if run_dir.is_dir() and safeio.DirLock.is_locked(run_dir):  # before reading files another run appends to
        raise safeio.LockedError(run_dir)
    probe = bundle_mod.Bundle(run_dir)
    m, done = probe.manifest, probe.steps
    probe.close()
    if m.task is None or m.config is None:
        raise config_mod.ConfigError(
            f"{run_dir}: recorded by a script: resume it by running the script with Session(..., resume=True)"
        )
    cfg = config_mod.validate(config_mod.apply_overrides(m.config, overrides))
    task = tasks.get(cfg.task)
    changed = sorted(
        k for k in _changed_keys(m.config, cfg.model_dump(mode="json")) if k not in task.resume_keys
    )
    if changed:
        allowed = ", ".join(sorted(task.resume_keys)) or "none"
        raise config_mod.ConfigError(
            f"--resume: --set {changed[0]} would change steps already recorded; a {cfg.task} run may change "
            f"only: {allowed}"
        )
    planned = task.planned_steps(cfg)
    if planned < done:
        raise config_mod.ConfigError(f"--resume: the bundle already holds {done} steps, more than {planned}")
    if m.status == "complete" and planned == done:
        raise config_mod.ConfigError(
            f"{run_dir}: complete: all {done} planned steps are recorded; nothing to resume"
        )
    return cfg


def _changed_keys(old: Any, new: Any, prefix: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        keys = set(old) | set(new)
        return [
            k for key in sorted(keys) for k in _changed_keys(old.get(key), new.get(key), f"{prefix}{key}.")
        ]
    return [] if old == new else [prefix[:-1]]


def cmd_train(args: argparse.Namespace) -> int:
    import signal

    import torch

    from detrl.run import config as config_mod
    from detrl.run import sessions, tasks

    cfg, out = _train_config(args)
    if not args.no_tensorboard:
        # before the bundle is touched: a refused start changes nothing on disk
        config_mod.check_tensorboard_dir(out / "tb")
    task = tasks.get(cfg.task)
    torch.set_num_threads(cfg.threads)
    session = sessions.session_for(cfg, out, "record", resume=bool(args.resume), force=args.force)

    def request_stop(signum: int, frame: object) -> None:  # Ctrl-C: finish the step, then a resumable bundle
        if session.stop_requested:
            raise KeyboardInterrupt
        session.stop_requested = True
        print("\ndetrl: stopping after this step (Ctrl-C again to abort)", file=sys.stderr)

    writer = None
    previous = signal.signal(signal.SIGINT, request_stop)
    t0 = time.perf_counter()
    try:
        with session:  # refuses an existing bundle (without --force) or a bundle another process writes
            if not args.no_tensorboard:  # only once the bundle is ours: a refused start leaves nothing behind
                if args.force:
                    shutil.rmtree(out / "tb", ignore_errors=True)
                writer = _TensorBoard(out / "tb", session)
                writer.add_text("config", "```yaml\n" + json.dumps(cfg.model_dump(), indent=1) + "\n```")
            try:
                metrics = task.run(cfg, session, progress=not args.quiet, writer=writer)
            except (RuntimeError, TypeError, IndexError) as e:
                # A config whose parts do not fit (a CNN fed text, a batch larger than the data) fails
                # inside torch or the task: the user's error, one line; the bundle keeps its durable steps.
                msg = " ".join(str(e).split())[:200] or type(e).__name__
                raise config_mod.ConfigError(
                    f"config {cfg.name}: the run fails ({type(e).__name__}: {msg})"
                ) from e
    finally:
        signal.signal(signal.SIGINT, previous)
        if writer is not None:
            writer.close()
    _print_trained(cfg, task, session, out, metrics, time.perf_counter() - t0)
    return 0


class _TensorBoard:
    """``detrl train``'s TensorBoard writer, opened at its first event once the bundle is the run's to change.

    While a resume re-records the steps its bundle holds (``session.rerecording``) the events wait in memory:
    a resume refused there (a step that differs) leaves no ``tb/`` behind, as it leaves the bundle unchanged.
    ``tb/`` is checked again (:func:`detrl.run.config.check_tensorboard_dir`) when the writer opens. Any
    ``add_*`` call is an event.
    """

    def __init__(self, path: Path, session: Any) -> None:
        self.path, self.session = path, session
        self._writer: Any = None
        self._pending: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("add_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self._event(name, args, kwargs)

    def _event(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._pending.append((name, args, kwargs))
        if not self.session.rerecording:
            self._flush()

    def _flush(self) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            from detrl.run.config import check_tensorboard_dir

            check_tensorboard_dir(self.path)
            self._writer = SummaryWriter(str(self.path))
        for name, args, kwargs in self._pending:
            getattr(self._writer, name)(*args, **kwargs)
        self._pending.clear()

    def close(self) -> None:
        """Write what waited if the run went past the steps its bundle held; otherwise (refused, or stopped
        there) drop it: the bundle is as it was, and so is ``tb/``."""
        try:
            if self._pending and not self.session.rerecording:
                self._flush()
        finally:
            if self._writer is not None:
                self._writer.close()


def _train_config(args: argparse.Namespace) -> tuple[Any, Path]:
    """The config and bundle directory of ``detrl train``: from CONFIG (with --set), or the bundle's own
    config for --resume, which allows neither --out, a CONFIG nor --force."""
    from detrl.run import config as config_mod

    if args.resume:
        for given, what in ((args.out, "--out"), (args.config, "a CONFIG file"), (args.force, "--force")):
            if given:
                raise config_mod.ConfigError(
                    f"--resume continues RUN_DIR in place with its own config: {what} is not allowed with it"
                )
        out = Path(args.resume)
        cfg = _resume_config(out, args.set)
    elif args.config:
        cfg = config_mod.load(args.config, args.set)
        out = Path(args.out or f"runs/{cfg.name}")
    else:
        raise config_mod.ConfigError("train needs a CONFIG file or --resume RUN_DIR")
    return cfg, out


def _print_trained(
    cfg: Any, task: Any, session: Any, out: Path, metrics: dict[str, Any], seconds: float
) -> None:
    """What ``detrl train`` says at the end: steps and loss, the greedy evaluation, the bundle and its log
    size, how to resume a stopped run, and how to audit it."""
    t = session.totals
    loss = metrics.get("loss", float("nan"))
    print(f"trained {cfg.name}: {session.step_index} steps in {seconds:.1f} s, final loss {loss:.4f}")
    if "eval_returns" in metrics:
        r = metrics["eval_returns"]
        print(f"greedy evaluation: mean return {sum(r) / max(1, len(r)):.1f} over {len(r)} episodes")
    print(f"bundle: {out}  (precision {cfg.precision}, hardware {cfg.hardware})")
    if cfg.precision == "verifiable":
        from detrl.formats.roundlog import dense_reference_bytes

        log_bytes = sum(session.log_bytes)
        dense = dense_reference_bytes(t.rounded_elements)
        largest = max(session.log_bytes[1:], default=0)  # this session's steps (the first: what came before)
        print(
            f"rounding log: {t.logged} elements, {format_bytes(log_bytes)} "
            f"({format_bytes(log_bytes / max(1, session.step_index))}/step, largest step "
            f"{format_bytes(largest)}); dense reference encoding "
            f"{format_bytes(dense)} ({dense / max(1, log_bytes):.0f}x larger)"
        )
    planned = task.planned_steps(cfg)
    if session.step_index < planned:
        print(f"stopped at step {session.step_index} of {planned}; continue with: detrl train --resume {out}")
    if cfg.precision == "verifiable":
        print(f"audit it with: detrl audit {out} --hardware emulated:splitk")
    else:  # without a rounding log only the recorder's own arithmetic reproduces it
        print(f"audit it with: detrl audit {out}  (other hardware needs precision: verifiable)")


def cmd_audit(args: argparse.Namespace) -> int:
    if args.workers > 1 and args.ray is None:  # the workers' imports overlap this process's, not follow them
        from detrl.run import executors

        executors.prestart()
    from detrl.apps.audit import audit, parse_caps
    from detrl.formats.bundle import BundleError
    from detrl.run.config import ConfigError

    if args.json:  # before the replay, which may take hours: a report nobody can write is refused now
        parent = Path(args.json).parent
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise ConfigError(
                f"--json {args.json!r}: {str(parent)!r} is not a directory this user can write to"
            )
    try:
        report = audit(
            args.run_dir,
            hardware=args.hardware,
            progress=not args.quiet,
            data=Path(args.data) if args.data else None,
            caps=parse_caps(args.cap),
            init_from=Path(args.init_from) if args.init_from else None,
            workers=args.workers,
            ray=args.ray,
        )
    except BundleError as e:
        if args.json:
            msg = str(e).splitlines()[0] if str(e) else "bad input"
            Path(args.json).write_text(json.dumps({"verdict": "bad input", "exit_code": 2, "message": msg}))
        raise
    tot = report.totals()
    print(f"{report.verdict.upper()} on {report.hardware}: {report.message}")
    if report.precision == "verifiable" and report.per_step:
        ratio = tot["dense_reference_bytes"] / max(1, tot["log_bytes"])
        print(
            f"rounding log: {tot['logged_elements']} elements, {format_bytes(tot['log_bytes'])} over "
            f"{len(report.per_step)} steps; dense reference {format_bytes(tot['dense_reference_bytes'])} "
            f"({ratio:.0f}x larger); replayer saw {report.unlogged_near} unlogged near-midpoint elements, "
            f"refused {report.refused} entries, and rounded {report.corrected} logged elements against its "
            "own nearest"
        )
    if args.stats:
        print(f"{'step':>6} {'rounded':>12} {'logged':>9} {'log bytes':>10} {'dense bytes':>12}")
        for s in report.per_step:
            print(f"{s.step:>6} {s.rounded:>12} {s.logged:>9} {s.log_bytes:>10} {s.dense_bytes:>12}")
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=1))
    return report.exit_code


def cmd_prove(args: argparse.Namespace) -> int:
    """Write the Merkle inclusion proof of one durable step of a bundle (stdout, or --out)."""
    from detrl.formats import proof
    from detrl.formats.bundle import Bundle

    b = Bundle(args.run_dir)  # the manifest, and the commitments against its Merkle root
    try:
        leaves, durable = b.leaves, b.manifest.durable
    finally:
        b.close()
    if durable is None or not leaves:
        raise ValueError(f"{args.run_dir}: no durable steps yet, nothing to prove")
    if not 0 <= args.step < len(leaves):
        raise ValueError(
            f"{args.run_dir}: step {args.step} is out of range: the bundle's durable steps are 0..{len(leaves) - 1}"
        )
    p = proof.prove(leaves, args.step)
    proof.verify(p, bytes.fromhex(durable.merkle_root))  # the proof leads to the manifest's root
    data = proof.encode(p)
    if args.out:
        Path(args.out).write_bytes(data)
        where = args.out
    else:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
        where = "stdout"
    print(
        f"proof of step {p.step} of durable steps 0..{p.leaves - 1} under root {p.root}: {where}",
        file=sys.stderr,
    )
    return 0


def cmd_verify_proof(args: argparse.Namespace) -> int:
    """Check a Merkle inclusion proof against --root, or against the root written in it (and say so)."""
    import re

    from detrl.formats import proof

    trusted = None
    if args.root is not None:
        if not re.fullmatch(r"[0-9a-fA-F]{64}", args.root):
            raise ValueError(f"--root {args.root[:80]!r}: not a Merkle root (64 hex digits)")
        trusted = bytes.fromhex(args.root)
    p = proof.read(args.proof)
    try:
        proof.verify(p, trusted, what=args.proof)
    except proof.ProofMismatch as e:
        print(f"NOT VERIFIED: {e}")
        return 1
    print(f"VERIFIED: step {p.step} is leaf {p.step} of the {p.leaves}-leaf tree with root {p.root}")
    print(f"  state hash {p.state_hash}, batch hash {p.batch_hash}")
    if trusted is None:
        print(
            "  checked against the root written in the proof itself: compare it with a root you trust (an "
            "audited bundle's manifest.json durable.merkle_root), or pass --root"
        )
    return 0


def cmd_dispute(args: argparse.Namespace) -> int:
    from detrl.apps.audit import parse_caps
    from detrl.apps.dispute import dispute
    from detrl.formats.bundle import BundleError
    from detrl.run.config import ConfigError

    if args.json:  # before the replays: a report nobody can write is refused now
        parent = Path(args.json).parent
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise ConfigError(
                f"--json {args.json!r}: {str(parent)!r} is not a directory this user can write to"
            )
    say = None if args.quiet else (lambda msg: print(f"[dispute] {msg}", file=sys.stderr, flush=True))
    try:
        v = dispute(
            args.run_a,
            args.run_b,
            referee=args.referee,
            data=Path(args.data) if args.data else None,
            init_from=Path(args.init_from) if args.init_from else None,
            caps=parse_caps(args.cap),
            progress=say,
        )
    except BundleError as e:
        if args.json:
            msg = str(e).splitlines()[0] if str(e) else "bad input"
            Path(args.json).write_text(json.dumps({"outcome": "bad input", "exit_code": 2, "message": msg}))
        raise
    print(f"{v.outcome.upper()}: {v.message}")
    if v.step is not None:
        logs = {
            None: "",
            True: "; the two logs' segments of it are identical",
            False: "; their logs differ there",
        }
        print(
            f"first differing step: {v.step} of {v.leaves - 1} ({v.comparisons} commitment comparisons, at most "
            f"{v.comparison_bound}){logs[v.logs_identical]}"
        )
        print(
            f"referee on {v.referee}: replayed each bundle from step {v.replay_from} in {v.replay_seconds:.1f} s; "
            f"reproduces: {v.reproduces}"
        )
    for b in v.blamed:
        print(f"blamed: {b.describe()}")
    print(f"exchanged: {format_bytes(v.bytes_exchanged)} in {v.messages} messages")
    if args.json:
        Path(args.json).write_text(json.dumps(v.to_json(), indent=1))
    return v.exit_code


def cmd_profiles(args: argparse.Namespace) -> int:
    from detrl.core.hardware import get_profile, profile_names

    names = profile_names()  # has cuda only where a CUDA device exists
    for name in names:
        note = " (available here)" if name == "cuda" else ""
        print(f"{name:<20} {get_profile(name).description}{note}")
    if "cuda" not in names:
        print(f"{'cuda':<20} a real GPU (not available here)")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from detrl import bench

    return bench.main(args.name, args.rest)


def cmd_ablate(args: argparse.Namespace) -> int:
    if (args.workers is None or args.workers > 1) and args.ray is None:  # workers import beside this process
        from detrl.run import executors

        executors.prestart()
    from detrl.apps import ablation

    sources = ablation.parse_sources(args.sources) if args.sources is not None else None
    spec = ablation.load_spec(args.config, runs=args.runs, sources=sources)
    out = Path(args.out or f"runs/ablate/{Path(args.config).stem}")
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers must be at least 1, not {args.workers}")
    workers = args.workers or os.cpu_count() or 1
    n_jobs = len(ablation.jobs(spec))
    where = f"on Ray ({args.ray})" if args.ray else f"in {workers} worker processes"
    print(
        f"ablate {args.config}: {len(ablation.conditions(spec))} conditions x {spec.runs} runs = {n_jobs} runs "
        f"in {out}, {where} with 1 torch thread each"
    )
    t0 = time.perf_counter()
    counts = ablation.run_sweep(spec, out, workers=workers, progress=not args.quiet, ray=args.ray)
    summary = ablation.summarise(out, command="detrl " + " ".join(args.argv), config=args.config)
    ablation.write_summary(out, summary)
    seconds = time.perf_counter() - t0
    print(f"ran {counts['done']} runs, skipped {counts['skipped']} already finished, in {seconds:.1f} s")
    print(ablation.format_table(summary))
    print(
        f"summary: {out / 'summary.json'}, {out / 'summary.csv'}; each run is a bundle: detrl audit {out}/runs/C/K"
    )
    print(f"report: detrl report {out}  (rerun this command to resume; --workers and --ray change no number)")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from detrl.apps import report

    made = report.make_report(args.dir)
    print(f"report: {made.markdown}")
    for path in made.files:
        print(f"  {path}")
    for name, why in made.skipped.items():
        print(f"  (not drawn: {name}: {why})")
    return 0


class _BenchHelp(argparse.Action):
    """``detrl bench --help``: the usage, then every benchmark with its description (plugins load only here)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        from detrl import bench

        try:
            listing = bench.describe()
        except ValueError as e:  # a contributed benchmark that does not load
            parser.error(str(e))
        parser.epilog = (
            f"benchmarks:\n{listing}\n\n"
            "`detrl bench NAME --help` shows that benchmark's options; BENCHMARKS.md has results."
        )
        parser.print_help()
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    from detrl import __version__

    p = argparse.ArgumentParser(prog="detrl", description="deterministic and verifiable training")
    p.add_argument("--version", action="version", version=f"detrl {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a config (records a bundle)")
    t.add_argument(
        "config", nargs="?", help="YAML config (a path, or a packaged name like configs/dqn/tiny.yaml)"
    )
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    t.add_argument("--out", help="bundle directory (default runs/NAME); an existing bundle is refused")
    t.add_argument("--force", action="store_true", help="replace a bundle already at --out")
    t.add_argument(
        "--resume", metavar="RUN_DIR", help="continue RUN_DIR from its last checkpoint to its planned steps"
    )
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.add_argument("--no-tensorboard", action="store_true")
    t.set_defaults(func=cmd_train)
    a = sub.add_parser(
        "audit",
        help="replay a bundle and give a verdict (exit codes below)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=AUDIT_EPILOG,
    )
    a.add_argument("run_dir")
    a.add_argument("--hardware", default="native", help="profile to replay on (see `detrl profiles`)")
    a.add_argument(
        "--data", metavar="PATH", help="the auditor's copy of the corpus or image directory the run trains on"
    )
    a.add_argument(
        "--init-from", metavar="PATH", help="the auditor's copy of the weights file the run starts from"
    )
    a.add_argument(
        "--cap",
        action="append",
        default=[],
        metavar="KEY=N",
        help="raise a cap on a config value read from the bundle (e.g. model.channels=4096)",
    )
    a.add_argument("--json", metavar="REPORT", help="write the report as JSON (every anomaly with its kind)")
    a.add_argument("--stats", action="store_true", help="per-step log size against the dense encoding")
    a.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="replay the segments between checkpoints in N worker processes, 1 torch thread each (default 1: "
        "one sequential replay); the verdict is the same",
    )
    a.add_argument(
        "--ray",
        metavar="auto|local|ADDRESS",
        help="replay the segments on Ray: auto (this machine's cluster, else a local instance), local, or a "
        "cluster address",
    )
    a.add_argument("--quiet", action="store_true")
    a.set_defaults(func=cmd_audit)
    pr = sub.add_parser(
        "prove",
        help="write the Merkle inclusion proof of one step (check it with detrl verify-proof)",
        description="Write the proof that STEP's commitment (state and batch hash) is a leaf under the "
        "bundle's durable Merkle root, as canonical JSON; a one-line summary goes to stderr. The format: "
        "docs/verifiable.md, 'Merkle inclusion proofs'.",
    )
    pr.add_argument("run_dir", metavar="RUN_DIR")
    pr.add_argument("step", metavar="STEP", type=int, help="a durable step (0 is the initial state)")
    pr.add_argument("--out", metavar="PROOF", help="write the proof to this file (default: stdout)")
    pr.set_defaults(func=cmd_prove)
    vp = sub.add_parser(
        "verify-proof",
        help="check a Merkle inclusion proof, without the bundle (exit codes below)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Recompute the root from the proof's step, state hash, batch hash and paths, without the\n"
        "bundle. Without --root the proof is checked against the root written in it: compare that root\n"
        "with one you trust. The format: docs/verifiable.md, 'Merkle inclusion proofs'.",
        epilog=VERIFY_PROOF_EPILOG,
    )
    vp.add_argument("proof", metavar="PROOF", help="the proof file (- reads standard input)")
    vp.add_argument("--root", metavar="HEX", help="the Merkle root you trust (64 hex digits)")
    vp.set_defaults(func=cmd_verify_proof)
    d = sub.add_parser(
        "dispute",
        help="two bundles of one config disagree: find the first differing step, replay it, blame an op",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=DISPUTE_EPILOG,
    )
    d.add_argument("run_a", metavar="RUN_A")
    d.add_argument("run_b", metavar="RUN_B")
    d.add_argument("--referee", default="native", metavar="PROFILE", help="the referee's hardware profile")
    d.add_argument("--data", metavar="PATH", help="the referee's copy of the data the run trains on")
    d.add_argument(
        "--init-from", metavar="PATH", help="the referee's copy of the weights the run starts from"
    )
    d.add_argument(
        "--cap", action="append", default=[], metavar="KEY=N", help="raise a cap on a config value"
    )
    d.add_argument("--json", metavar="REPORT", help="write the verdict as JSON")
    d.add_argument("--quiet", action="store_true", help="no progress lines")
    d.set_defaults(func=cmd_dispute)
    sub.add_parser("profiles", help="list hardware profiles").set_defaults(func=cmd_profiles)
    ab = sub.add_parser("ablate", help="vary each source of randomness in turn (an ablation sweep)")
    ab.add_argument("config", help="ablation config (e.g. configs/ablate/dqn_tiny.yaml)")
    ab.add_argument("--runs", type=int, metavar="N", help="runs per condition (default: the config's)")
    ab.add_argument("--sources", metavar="A,B", help="sources to vary (default: the config's)")
    ab.add_argument("--workers", type=int, metavar="N", help="worker processes (default: all CPUs)")
    ab.add_argument(
        "--ray",
        metavar="auto|local|ADDRESS",
        help="run on Ray: auto (this machine's cluster, else a local instance), local, or a cluster address",
    )
    ab.add_argument("--out", metavar="DIR", help="sweep directory (default runs/ablate/NAME); reruns resume")
    ab.add_argument("--quiet", action="store_true", help="no progress bar")
    ab.set_defaults(func=cmd_ablate)
    rp = sub.add_parser(
        "report",
        help="turn an ablation sweep into a Markdown report with plots (DIR/report/)",
        description="Write DIR/report/report.md, PNG plots and numbers.csv/json from DIR/summary.json of "
        "`detrl ablate --out DIR`. Regenerating from the same summary.json gives the same bytes.",
    )
    rp.add_argument("dir", metavar="DIR", help="the sweep directory (the --out of detrl ablate)")
    rp.set_defaults(func=cmd_report)
    b = sub.add_parser(
        "bench",
        help="run a benchmark from BENCHMARKS.md (list: detrl bench --help)",
        add_help=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a benchmark from BENCHMARKS.md.",
    )
    b.add_argument("-h", "--help", action=_BenchHelp, help="list the benchmarks and exit")
    b.add_argument("name", metavar="NAME", help="the benchmark to run (listed below)")
    b.add_argument(
        "rest", nargs=argparse.REMAINDER, metavar="OPTIONS", help="its options (see detrl bench NAME --help)"
    )
    b.set_defaults(func=cmd_bench)
    return p


def _caused_by_ctrl_c(e: BaseException) -> bool:
    """Whether ``e`` arose from a KeyboardInterrupt (its cause or context chain holds one)."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, KeyboardInterrupt):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


#: Set once the user pressed Ctrl-C in this ``detrl`` process (see :func:`_note_ctrl_c`).
_ctrl_c_pressed = False


def _note_ctrl_c(signum: int, frame: object) -> None:
    """Python's own Ctrl-C behaviour (raise KeyboardInterrupt), remembered: an interrupt that lands inside
    an import can surface later as another error (a RecursionError from a half-imported module was seen),
    which is the interrupt's doing, not a defect to report."""
    global _ctrl_c_pressed
    _ctrl_c_pressed = True
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the `detrl` process itself (a test calling main() keeps its own handlers)
        import signal

        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _note_ctrl_c)
    try:
        args = build_parser().parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)  # the command as typed, for reports
        return int(args.func(args))
    except KeyboardInterrupt:
        print("detrl: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `detrl ... | head`: the reader left; nothing is wrong
        os.dup2(
            os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno()
        )  # so the exit's flush cannot fail again
        return 0
    except Exception as e:  # noqa: BLE001 - the user sees one line; DETRL_DEBUG=1 shows the traceback
        if _ctrl_c_pressed or _caused_by_ctrl_c(
            e
        ):  # a C extension's import interrupted: SystemError "... with an exception set"
            print("detrl: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        if os.environ.get("DETRL_DEBUG"):
            raise
        from detrl.formats.bundle import BundleError
        from detrl.formats.roundlog import RoundLogError
        from detrl.run.config import ConfigError
        from detrl.run.executors import JobFailed

        if isinstance(
            e, (ConfigError, BundleError, RoundLogError)
        ):  # ours: one line, whatever paths it names
            msg = str(e).replace("\r", "\\r").replace("\n", "\\n")
        else:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if isinstance(e, (ConfigError, BundleError, RoundLogError, OSError, ValueError, JobFailed)):
            print(f"detrl: error: {msg}", file=sys.stderr)
            return EXIT_BAD_INPUT
        print(f"detrl: internal error: {type(e).__name__}: {msg}", file=sys.stderr)
        return EXIT_INTERNAL
    finally:
        if argv is None:  # the `detrl` process itself: the command is over, and a Ctrl-C that comes now
            import signal  # (a second one, late) would print a traceback from the interpreter's exit

            signal.signal(signal.SIGINT, signal.SIG_IGN)


if __name__ == "__main__":
    sys.exit(main())
