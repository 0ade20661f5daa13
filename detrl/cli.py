"""``detrl train | audit | profiles | bench``.

Exit codes: 0 success (audit: replicated), 1 audit diverged, 2 bad input (config, bundle, arguments).
Every error a user can cause is one line on stderr, never a traceback (set DETRL_DEBUG=1 to see one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch


def format_bytes(n: float) -> str:
    """``1234567`` -> ``'1.2 MB'`` (decimal units)."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def cmd_train(args: argparse.Namespace) -> int:
    import signal

    from detrl import bundle as bundle_mod
    from detrl import config as config_mod
    from detrl.engine import Session
    from detrl.sources import Sources

    if args.resume:
        out = Path(args.resume)
        if args.config:
            cfg = config_mod.load(args.config, args.set)
        else:  # the bundle's own config, with --set overrides (e.g. more train.steps)
            probe = bundle_mod.Bundle(out)
            probe.close()
            cfg = config_mod.validate(config_mod.apply_overrides(probe.config, args.set))
    elif args.config:
        cfg = config_mod.load(args.config, args.set)
        out = Path(args.out or f"runs/{cfg.name}")
    else:
        raise config_mod.ConfigError("train needs a CONFIG file or --resume RUN_DIR")
    task = config_mod.recipe(cfg.task)
    torch.set_num_threads(cfg.threads)
    writer = None
    if not args.no_tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(out / "tb"))
        writer.add_text("config", "```yaml\n" + json.dumps(cfg.model_dump(), indent=1) + "\n```")
    options = task.session_options(cfg) if hasattr(task, "session_options") else {}
    session = Session(
        out, mode="record", precision=cfg.precision, sources=Sources.from_config(cfg.sources),
        hardware=cfg.hardware, checkpoint_every=cfg.verify.checkpoint_every, margin=cfg.verify.margin,
        config=cfg.model_dump(mode="json"), data_fingerprint=task.fingerprint(cfg),
        resume=bool(args.resume), **options,
    )  # fmt: skip

    def request_stop(signum: int, frame: object) -> None:  # Ctrl-C: finish the step, then a resumable bundle
        if session.stop_requested:
            raise KeyboardInterrupt
        session.stop_requested = True
        print("\ndetrl: stopping after this step (Ctrl-C again to abort)", file=sys.stderr)

    previous = signal.signal(signal.SIGINT, request_stop)
    t0 = time.perf_counter()
    try:
        with session:
            metrics = task.run(cfg, session, progress=not args.quiet, writer=writer)
    finally:
        signal.signal(signal.SIGINT, previous)
    seconds = time.perf_counter() - t0
    if writer is not None:
        writer.close()
    t = session.totals
    print(
        f"trained {cfg.name}: {session.step_index} steps in {seconds:.1f} s, final loss {metrics['loss']:.4f}"
    )
    if "eval_returns" in metrics:
        r = metrics["eval_returns"]
        print(f"greedy evaluation: mean return {sum(r) / max(1, len(r)):.1f} over {len(r)} episodes")
    print(f"bundle: {out}  (precision {cfg.precision}, hardware {cfg.hardware})")
    if cfg.precision == "verifiable":
        from detrl.roundlog import dense_reference_bytes

        log_bytes = sum(session.log_bytes)
        dense = dense_reference_bytes(t.rounded_elements)
        print(
            f"rounding log: {t.logged} elements, {format_bytes(log_bytes)} "
            f"({format_bytes(log_bytes / max(1, session.step_index))}/step); dense reference encoding "
            f"{format_bytes(dense)} ({dense / max(1, log_bytes):.0f}x larger)"
        )
    if session.stop_requested:
        print(f"stopped early; continue with: detrl train --resume {out} --set train.steps=N")
    if cfg.precision == "verifiable":
        print(f"audit it with: detrl audit {out} --hardware emulated:splitk")
    else:  # without a rounding log only the recorder's own arithmetic reproduces it
        print(f"audit it with: detrl audit {out}  (other hardware needs precision: verifiable)")
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    from detrl.audit import audit

    report = audit(args.run_dir, hardware=args.hardware, progress=not args.quiet)
    tot = report.totals()
    print(f"{report.verdict.upper()} on {report.hardware}: {report.message}")
    if report.precision == "verifiable" and (report.verdict == "replicated" or report.per_step):
        ratio = tot["dense_reference_bytes"] / max(1, tot["log_bytes"])
        print(
            f"rounding log: {tot['logged_elements']} elements, {format_bytes(tot['log_bytes'])} over "
            f"{len(report.per_step)} steps; dense reference {format_bytes(tot['dense_reference_bytes'])} "
            f"({ratio:.0f}x larger); replayer saw {report.unlogged_near} unlogged near-midpoint elements, "
            f"{report.corrected} logged elements rounded against its own nearest"
        )
    if args.stats:
        print(f"{'step':>6} {'rounded':>12} {'logged':>9} {'log bytes':>10} {'dense bytes':>12}")
        for s in report.per_step:
            print(f"{s.step:>6} {s.rounded:>12} {s.logged:>9} {s.log_bytes:>10} {s.dense_bytes:>12}")
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=1))
    return report.exit_code


def cmd_profiles(args: argparse.Namespace) -> int:
    from detrl.hardware import get_profile, profile_names

    for name in profile_names():
        print(f"{name:<20} {get_profile(name).description}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from detrl import bench

    return bench.main(args.name, args.rest)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="detrl", description="deterministic and verifiable training")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a config (records a bundle)")
    t.add_argument("config", nargs="?", help="YAML config (optional with --resume: the bundle's own)")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    t.add_argument("--out", help="bundle directory (default runs/NAME)")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue a bundle from its last checkpoint")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.add_argument("--no-tensorboard", action="store_true")
    t.set_defaults(func=cmd_train)
    a = sub.add_parser("audit", help="replay a bundle; exit 0 replicated, 1 diverged, 2 bad input")
    a.add_argument("run_dir")
    a.add_argument("--hardware", default="native", help="profile to replay on (see `detrl profiles`)")
    a.add_argument("--json", metavar="REPORT", help="write the report as JSON")
    a.add_argument("--stats", action="store_true", help="per-step log size against the dense encoding")
    a.add_argument("--quiet", action="store_true")
    a.set_defaults(func=cmd_audit)
    sub.add_parser("profiles", help="list hardware profiles").set_defaults(func=cmd_profiles)
    b = sub.add_parser("bench", help="run a benchmark from BENCHMARKS.md")
    b.add_argument("name")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    from detrl.bundle import BundleError
    from detrl.config import ConfigError
    from detrl.roundlog import RoundLogError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ConfigError, BundleError, RoundLogError, FileNotFoundError, ValueError) as e:
        if os.environ.get("DETRL_DEBUG"):
            raise
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"detrl: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("detrl: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the user sees one line; DETRL_DEBUG shows the traceback
        if os.environ.get("DETRL_DEBUG"):
            raise
        print(
            f"detrl: internal error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
            file=sys.stderr,
        )
        return 3


if __name__ == "__main__":
    sys.exit(main())
