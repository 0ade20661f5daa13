"""Trust benchmarks: ``nolog`` (replays with the log emptied), ``replication`` (the paper's experiment),
``fuzz`` (mutation-fuzz the bundle readers, or forged bundles through the real audit) and ``hostile``
(audit hostile bundles)."""

from __future__ import annotations

import argparse
import collections
import random
import shutil
import signal
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from detrl.apps import replication as rep
from detrl.apps.audit import VERDICT_OF_EXIT, audit
from detrl.bench.common import (
    EMULATED,
    MODEL_CONFIGS,
    make_config,
    mean_sd,
    model_list,
    progress,
    record,
    record_small_digits,
    reset_peak_rss,
    status_kb,
)
from detrl.bench.registry import benchmark
from detrl.core.hardware import get_profile
from detrl.run.fmt import format_bytes, machine_line, table
from detrl.testing import auditfuzz, fuzzing, hostile
from detrl.testing.logrewrite import strip_log


@benchmark("nolog", "replay a verifiable run on each emulated profile with its log and with it emptied")
def bench_nolog(rest: list[str]) -> int:
    p = argparse.ArgumentParser(prog="detrl bench nolog")
    p.add_argument("--model", default="digits_cnn", help="one of " + ",".join(MODEL_CONFIGS))
    p.add_argument("--steps", type=int, default=100, help="steps of the recorded run")
    p.add_argument("--profiles", default=",".join(EMULATED))
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(rest)
    model_list(args.model)
    torch.set_num_threads(args.threads)
    profiles = [q.strip() for q in args.profiles.split(",") if q.strip()]
    print(machine_line(args.threads))
    batch = MODEL_CONFIGS[args.model]["train"]["batch_size"]
    print(
        f"{args.model}, batch {batch}, {args.steps} steps, recorded on native; replayed with `detrl.apps.audit.audit`"
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="detrl-bench-") as tmp:
        runs: dict[str, Path] = {}
        for precision in ("verifiable", "fp32"):
            t0 = time.perf_counter()
            runs[precision] = Path(tmp) / precision
            s = record(make_config(args.model, precision, args.steps, args.threads), runs[precision])
            progress(f"recorded {precision}: {args.steps} steps in {time.perf_counter() - t0:.0f} s")
            if precision == "verifiable":
                total_logged = s.totals.logged
        runs["nolog"] = Path(tmp) / "nolog"
        strip_log(runs["verifiable"], runs["nolog"])
        variants: list[tuple[str, Path]] = [
            ("verifiable, with log", runs["verifiable"]),
            ("verifiable, log emptied", runs["nolog"]),
            ("fp32 (control)", runs["fp32"]),
        ]
        for prof in profiles:
            for label, run_dir in variants:
                t0 = time.perf_counter()
                r = audit(run_dir, prof, require_log=False)  # measures replication, not compliance
                progress(f"{prof} {label}: {r.verdict} ({time.perf_counter() - t0:.0f} s)")
                first = str(r.diverged_step) if r.diverged_step is not None else f"none in {args.steps} steps"
                rows.append([prof, label, r.verdict, first, str(r.corrected), str(r.unlogged_near)])
    print(f"recorded log: {total_logged:,} logged elements over {args.steps} steps")
    print(table(["profile", "bundle", "verdict", "first diverging step", "corrected", "unlogged near"], rows))
    print(
        "corrected: logged elements whose replayer-nearest rounding differed from the log (where the log "
        "mattered); unlogged near: near-midpoint elements the replayer saw that the log did not list"
    )
    return 0


@benchmark(
    "replication", "the paper's replication experiment: fp32, rounded without log, verifiable per profile"
)
def bench_replication(rest: list[str]) -> int:
    """Srivastava, Arora & Boneh's experiment as one table (see :mod:`detrl.apps.replication`): each model is
    recorded on ``native`` and trained or replayed on every other profile in plain FP32, in verifiable
    precision without the trainer's log, and with it. Then learning quality: test loss and accuracy of
    plain FP32 against verifiable training. Long runs: progress on stderr, ``--progress`` for step bars."""
    p = argparse.ArgumentParser(prog="detrl bench replication", description=bench_replication.__doc__)
    p.add_argument(
        "--models",
        default="resnet50_tiny,gpt2_tiny",
        help="configs/supervised/NAME.yaml, comma-separated (resnet50 and gpt2 are the full models)",
    )
    p.add_argument("--steps", type=int, default=10, help="steps of every run in the replication table")
    p.add_argument("--profiles", default="", help="auditor profiles (default: every profile but native)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override every config")
    p.add_argument(
        "--quality-models",
        default="resnet50_tiny,gpt2_tiny",
        help="models of the quality table ('' for none)",
    )
    p.add_argument("--quality-steps", type=int, default=500, help="training steps of the quality table")
    p.add_argument("--quality-seeds", type=int, default=3, help="seeds per precision in the quality table")
    p.add_argument("--holdout", type=int, default=256, help="held-out examples (token windows) to test on")
    p.add_argument("--progress", action="store_true", help="a progress bar over each run's steps")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(rest)
    torch.set_num_threads(args.threads)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    auditors = rep.auditor_profiles([q.strip() for q in args.profiles.split(",") if q.strip()])
    for name in models:  # a bad name, override or profile fails here, in one line, before any work
        rep.load_model_config(name, args.steps, args.set)
    for auditor in auditors:
        get_profile(auditor)
    print(machine_line(args.threads))
    print(
        f"recorded on {rep.RECORDER}, {args.steps} steps; audited on {', '.join(auditors)}. fp32: trained in "
        "plain FP32 on the auditor; rounded: verifiable precision on the auditor without the trainer's log; "
        "verifiable: the trainer's bundle replayed with its log"
    )
    t0 = time.perf_counter()
    costs, rows = rep.run_experiment(models, args.steps, auditors, args.set, progress, args.progress)
    print(table(
        ["model", "batch", "params", "logged el./step", "log B/step", "dense B/step", "dense/log",
         "step-1 log B", "verif./FP64", "verif./FP32"],
        [[c.model, c.batch, f"{c.parameters:,}", f"{c.logged_per_step:,.0f}", format_bytes(c.log_bytes_per_step),
          format_bytes(c.dense_bytes_per_step), f"{c.dense_bytes_per_step / max(c.log_bytes_per_step, 1):,.0f}x",
          format_bytes(c.log_bytes_step1), f"{c.vs_fp64:.2f}x", f"{c.vs_fp32:.2f}x"] for c in costs],
    ))  # fmt: skip
    print()
    print(table(
        ["model", "trainer -> auditor", "mode", "first divergence", "L2 at end", "corrected", "verdict"],
        [[r.model, f"{rep.RECORDER} -> {r.auditor}", r.mode,
          str(r.first_divergence) if r.first_divergence is not None else f"none in {r.steps} steps",
          "n/a" if r.l2 is None else f"{r.l2:.3g}", "" if r.corrected is None else str(r.corrected), r.verdict]
         for r in rows],
    ))  # fmt: skip
    print(
        "log/dense bytes: means over steps 2..N (step 1 calibrates, and its log is given alone); step times: "
        "medians over steps 2..N of the trainer's own recordings; corrected: logged elements whose auditor-"
        "nearest rounding differed from the log (where the log mattered)"
    )
    quality = [m.strip() for m in args.quality_models.split(",") if m.strip()]
    if quality and args.quality_steps > 0 and args.quality_seeds > 0:
        qrows = []
        for name in quality:
            cfg = rep.load_model_config(name, args.quality_steps, args.set)
            runs = rep.learning_quality(cfg, args.holdout, range(args.quality_seeds), progress, args.progress)
            for precision in ("fp32", "verifiable"):
                qs = [q for q in runs if q.precision == precision]
                qrows.append([
                    name, precision, str(len(qs)), mean_sd([q.train_loss for q in qs]),
                    mean_sd([q.test_loss for q in qs]), mean_sd([q.test_accuracy for q in qs], 100, 2) + " %",
                    " ".join(f"{100 * q.test_accuracy:.1f}" for q in qs),
                ])  # fmt: skip
        print()
        print(
            f"learning quality: {args.quality_steps} steps on {rep.RECORDER}, seeds 0..{args.quality_seeds - 1}, "
            f"{args.holdout} held-out examples (token windows); mean ± SD over seeds"
        )
        print(table(["model", "precision", "seeds", "final train loss", "test loss", "test accuracy",
                     "accuracy per seed %"], qrows))  # fmt: skip
    print(f"total {time.perf_counter() - t0:.0f} s")
    bad = [r for r in rows if r.mode == "verifiable" and r.verdict != "replicated"]
    return 1 if bad else 0


class _CaseTimeout(BaseException):
    """A fuzz case ran past --case-timeout (a BaseException: no reader's error handling swallows it)."""


@benchmark("fuzz", "fuzz the bundle readers, or the real audit (--path audit): outcomes, crashes, memory")
def bench_fuzz(rest: list[str]) -> int:
    """Run --cases cases of :func:`detrl.testing.fuzzing.fuzz_case` over a freshly recorded bundle, in-process, each
    under a time limit (``--path audit``: forged bundles, each audited by a fork of the real command). A
    crash (an exception other than the reader's own error) or a timeout exits 1."""
    p = argparse.ArgumentParser(prog="detrl bench fuzz", description=bench_fuzz.__doc__)
    p.add_argument("--cases", type=int, default=100_000, help="fuzz cases to run (default 100000)")
    p.add_argument("--seed", type=int, default=0, help="case i draws from random.Random(f'{seed}:{i}')")
    p.add_argument("--targets", default=",".join(fuzzing.TARGETS), help="comma list, taken in turn")
    p.add_argument("--case-timeout", type=float, default=10.0, help="seconds per case (more: a hang)")
    p.add_argument("--show", type=int, default=3, help="tracebacks shown of the first N distinct crashes")
    p.add_argument(
        "--path",
        choices=("readers", "audit"),
        default="readers",
        help="readers: damage bytes and call the readers in-process; audit: forge bundles consistently "
        "and fork the real `detrl audit` per case (detrl.testing.auditfuzz)",
    )
    p.add_argument("--workers", type=int, default=2, help="--path audit: audits in flight at once")
    args = p.parse_args(rest)
    if args.path == "audit":
        return _fuzz_audit(args)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    for t in targets:
        if t not in fuzzing.TARGETS:
            raise ValueError(f"unknown fuzz target {t!r}; known: {', '.join(fuzzing.TARGETS)}")
    if args.cases < 1 or args.case_timeout <= 0:
        raise ValueError("--cases and --case-timeout must be positive")
    print(machine_line(1))

    def on_alarm(signum: int, frame: Any) -> None:
        raise _CaseTimeout

    outcomes: collections.Counter[tuple[str, str]] = collections.Counter()
    outcomes_of = lambda *kinds: sum(n for (_, k), n in outcomes.items() if k in kinds)  # noqa: E731
    crashes: dict[tuple[str, str, str], list[tuple[str, str]]] = {}
    slowest: dict[str, float] = collections.defaultdict(float)
    worst = (0.0, "", "")
    previous = signal.signal(signal.SIGALRM, on_alarm)
    with tempfile.TemporaryDirectory(prefix="detrl-fuzz-") as tmp:
        run, work = Path(tmp) / "run", Path(tmp) / "work" / "run"
        progress("recording the base bundle (digits_cnn, 8 steps, checkpoints at 4 and 8) ...")
        record_small_digits(run)
        base = fuzzing.BaseBundle.load(run, work)
        reset_ok = reset_peak_rss()
        t_start = time.perf_counter()
        try:
            for i in range(args.cases):
                seed, target = f"{args.seed}:{i}", targets[i % len(targets)]
                t0 = time.perf_counter()
                signal.setitimer(signal.ITIMER_REAL, args.case_timeout)
                try:
                    kind = fuzzing.fuzz_case(random.Random(seed), base, target).partition(":")[2]
                except _CaseTimeout:
                    kind = "timeout"
                    key, tb = (target, "timeout", f"> {args.case_timeout:g} s"), ""
                    crashes.setdefault(key, []).append((seed, tb))
                except Exception as e:  # noqa: BLE001 - a crash is what this benchmark looks for
                    kind = "crash"
                    frame = traceback.extract_tb(e.__traceback__)[-1]
                    key = (target, type(e).__name__, f"{Path(frame.filename).name}:{frame.lineno}")
                    crashes.setdefault(key, []).append((seed, traceback.format_exc()))
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                dt = time.perf_counter() - t0
                if kind == "timeout":  # the scratch copy may be half restored
                    base = fuzzing.BaseBundle.load(run, work)
                outcomes[(target, kind)] += 1
                slowest[target] = max(slowest[target], dt)
                if dt > worst[0]:
                    worst = (dt, seed, target)
                if (i + 1) % max(1, args.cases // 10) == 0:
                    rate = (i + 1) / (time.perf_counter() - t_start)
                    bad = outcomes_of("crash", "timeout")
                    progress(f"{i + 1}/{args.cases} cases, {rate:.0f}/s, {bad} crashes or timeouts")
        finally:
            signal.signal(signal.SIGALRM, previous)
        elapsed = time.perf_counter() - t_start
    peak_kb = status_kb("VmHWM")
    kinds = ["accepted", "BundleError", "RoundLogError", "timeout", "crash"]
    rows = [
        [
            t,
            str(sum(n for (tt, _), n in outcomes.items() if tt == t)),
            *(str(outcomes[(t, k)]) for k in kinds),
            f"{slowest[t] * 1e3:.1f}",
        ]
        for t in targets
    ]
    print(table(["target", "cases", *kinds, "slowest ms"], rows))
    ran, found = sum(outcomes.values()), outcomes_of("crash", "timeout")
    print(f"cases run: {ran} in {elapsed:.1f} s ({ran / elapsed:.0f}/s)")
    print("outcomes: " + ", ".join(f"{k} {outcomes_of(k)}" for k in kinds))
    crashed, timed_out = outcomes_of("crash"), outcomes_of("timeout")
    print(f"crashes found: {crashed}, timeouts: {timed_out} ({len(crashes)} distinct)")
    for n, ((target, exc, where), hits) in enumerate(sorted(crashes.items(), key=lambda kv: -len(kv[1]))):
        replay = f"fuzz_case(Random({hits[0][0]!r}), base, {target!r})"
        print(f"  {target}: {exc} at {where}, {len(hits)} cases; replay: {replay}")
        if n < args.show and hits[0][1]:
            for line in hits[0][1].rstrip().splitlines()[-6:]:
                print(f"    {line}")
    print(f"worst case: {worst[0] * 1e3:.1f} ms (seed {worst[1]!r}, target {worst[2]})")
    scope = "while fuzzing (reset after recording)" if reset_ok else "of the process, recording included"
    print(f"peak RSS {scope}: {format_bytes(peak_kb * 1024)}")
    if args.cases != 100_000:
        print(f"at this rate, 100,000 cases take about {100_000 * elapsed / args.cases / 60:.1f} min")
    return 1 if found else 0


def _fuzz_audit(args: argparse.Namespace) -> int:
    """``detrl bench fuzz --path audit``: :mod:`detrl.testing.auditfuzz` cases, each a forged bundle
    audited by a fork of the real command; a crash is an exit code outside the verdicts (70), a signal,
    a traceback or a timeout. Prints outcomes per kind of forgery, crash signatures with their replays,
    the rate and the children's peak RSS against the honest audit's."""
    import subprocess
    import sys

    if args.cases < 1 or args.case_timeout <= 0 or args.workers < 1:
        raise ValueError("--cases, --case-timeout and --workers must be positive")
    print(machine_line(1))
    with tempfile.TemporaryDirectory(prefix="detrl-auditfuzz-") as tmp:
        run = Path(tmp) / "base"
        progress("recording the base bundle (digits_cnn, 4 steps, checkpoints at 2 and 4) ...")
        subprocess.run(  # in a child: this process must start no torch thread pool before it forks
            [sys.executable, "-m", "detrl.cli", "train", "configs/supervised/digits_cnn.yaml", "--set",
             "train.steps=4", "--set", "verify.checkpoint_every=2", "--out", str(run), "--quiet"],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        forgers = [auditfuzz.Forger(run, Path(tmp) / f"slot{k}" / "run") for k in range(args.workers)]
        auditfuzz.warm_up(run)
        honest = auditfuzz.audit_forked(run, args.case_timeout)
        if honest.code != 0:
            raise RuntimeError(f"the honest base bundle did not replicate: {honest.line}")
        outcomes: collections.Counter[tuple[str, str]] = collections.Counter()
        crashes: dict[str, list[tuple[str, str]]] = {}
        worst = {"rss": 0, "seconds": 0.0, "seed": ""}
        whats: dict[int, str] = {}
        t_start = time.perf_counter()

        def prepare(slot: int, seed: str) -> None:
            whats[slot] = forgers[slot].forge(random.Random(seed))

        def done(slot: int, seed: str, o: auditfuzz.Outcome) -> None:
            forgers[slot].restore()
            kind, what = whats[slot].partition(":")[::2]
            outcomes[(kind, "crash" if o.crashed else str(o.code))] += 1
            if o.crashed:
                crashes.setdefault(auditfuzz.signature(o), []).append((seed, whats[slot]))
            worst["rss"] = max(worst["rss"], o.peak_rss)
            if o.seconds > worst["seconds"]:
                worst.update(seconds=o.seconds, seed=seed)
            n = sum(outcomes.values())
            if n % max(1, args.cases // 20) == 0:
                rate = n / (time.perf_counter() - t_start)
                progress(f"{n}/{args.cases} cases, {rate:.1f}/s, {sum(map(len, crashes.values()))} crashes")

        seeds = [f"{args.seed}:{i}" for i in range(args.cases)]
        slots = [f.workdir for f in forgers]
        auditfuzz.run_forked(slots, seeds, args.case_timeout, done, prepare)
        elapsed = time.perf_counter() - t_start
    codes = ["0", "1", "2", "3", "4", "crash"]
    rows = [
        [
            kind,
            str(sum(n for (k, _), n in outcomes.items() if k == kind)),
            *(str(outcomes[(kind, c)]) for c in codes),
        ]
        for kind in auditfuzz.KINDS
    ]
    print(table(["forgery", "cases", *(f"exit {c}" if c != "crash" else c for c in codes)], rows))
    ran = sum(outcomes.values())
    n_crash = sum(map(len, crashes.values()))
    print(f"cases run: {ran} in {elapsed:.1f} s ({ran / elapsed:.1f}/s, {args.workers} at a time)")
    print(
        f"crashes (exit 70, other codes, signals, tracebacks, timeouts): {n_crash} ({len(crashes)} distinct)"
    )
    for sig, hits in sorted(crashes.items(), key=lambda kv: -len(kv[1])):
        print(
            f"  {sig}: {len(hits)} cases; replay: Forger(...).forge(Random({hits[0][0]!r}))  # {hits[0][1]}"
        )
    print(f"slowest case: {worst['seconds']:.2f} s (seed {worst['seed']!r})")
    print(
        f"peak RSS of an audit child: {format_bytes(worst['rss'])} at most, the honest audit's "
        f"{format_bytes(honest.peak_rss)} (+{format_bytes(max(0, worst['rss'] - honest.peak_rss))})"
    )
    if args.cases != 100_000:
        print(f"at this rate, 100,000 cases take about {100_000 * elapsed / ran / 60:.0f} min")
    return 1 if crashes else 0


@benchmark("hostile", "audit hostile bundles (bombs, caps, FIFOs, links, deep JSON, pickles): time, peak RSS")
def bench_hostile(rest: list[str]) -> int:
    """Record a digits CNN bundle (8 steps, checkpoints at 4 and 8), plant each case of
    :func:`detrl.testing.hostile.hostile_cases` (the constructions of tests/test_hostile.py) in a copy of it and
    audit the copy in a fresh ``python -m detrl.cli audit COPY --quiet`` under a timeout: exit code, first
    line of output, wall time and the child's own peak RSS (``os.wait4``). Exits 1 if any case exits
    outside 0-4, prints a traceback or an internal error, times out, trips a tripwire (a planted pickle
    ran) or peaks over 1 GB."""

    p = argparse.ArgumentParser(prog="detrl bench hostile", description=bench_hostile.__doc__)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per audit (more: a hang)")
    args = p.parse_args(rest)
    if args.timeout <= 0:
        raise ValueError("--timeout must be positive")
    rss_limit = 10**9  # 1 GB
    print(machine_line(1))
    t_start = time.perf_counter()
    rows, results, failures = [], [], []
    with tempfile.TemporaryDirectory(prefix="detrl-hostile-") as tmp:
        recorded = Path(tmp) / "recorded"
        progress("recording the base bundle (digits_cnn, 8 steps, checkpoints at 4 and 8) ...")
        record_small_digits(recorded)
        for i, (name, plant) in enumerate(hostile.hostile_cases()):
            scratch = Path(tmp) / f"case-{i:02d}"
            run = scratch / "run"
            shutil.copytree(recorded, run)
            progress(f"{name}: planting and auditing ...")
            tripwires = plant(run, scratch)
            rc, out, err, rss, wall = hostile.audit_subprocess(run, timeout=args.timeout)
            first = next((ln.strip() for ln in (err + "\n" + out).splitlines() if ln.strip()), "")
            problems = []
            if rc is None:
                problems.append(f"timed out after {args.timeout:g} s")
            elif rc not in (0, 1, 2, 3, 4):
                problems.append(f"exit {rc}")
            elif name in hostile.EXPECTED_EXIT and rc != hostile.EXPECTED_EXIT[name]:
                problems.append(f"exit {rc}, not {hostile.EXPECTED_EXIT[name]}")
            problems += [f"printed {bad!r}" for bad in ("Traceback", "internal error") if bad in out + err]
            if rss is None and rc is not None:
                problems.append("peak RSS unknown (the launcher failed)")
            elif rss is not None and rss > rss_limit:
                problems.append(f"peak RSS {rss / 1e6:.0f} MB > 1 GB")
            problems += [f"tripwire {t.name} exists (a planted pickle ran)" for t in tripwires if t.exists()]
            shutil.rmtree(scratch)
            if problems:
                failures.append(f"{name}: {'; '.join(problems)}")
            results.append((name, rss or 0, wall))
            code = (
                "timeout"
                if rc is None
                else f"{rc} ({VERDICT_OF_EXIT[rc]})"
                if rc in VERDICT_OF_EXIT
                else str(rc)
            )
            rows.append([name, code, first[:70], f"{wall:.2f}", "?" if rss is None else f"{rss / 1e6:.0f}"])
    width = max(len(r[2]) for r in rows)
    rows = [[*r[:2], r[2].ljust(width), *r[3:]] for r in rows]  # _table right-aligns all but the first
    print(table(["case", "exit", "first line of stderr/stdout", "wall s", "peak RSS MB"], rows))
    by_rss, by_time = max(results, key=lambda r: r[1]), max(results, key=lambda r: r[2])
    print(
        f"worst by peak RSS: {by_rss[0]} ({by_rss[1] / 1e6:.0f} MB); worst by time: {by_time[0]} "
        f"({by_time[2]:.2f} s); {len(results)} cases, {time.perf_counter() - t_start:.0f} s in all "
        "(recording and planting included)"
    )
    if rows[0][1] != f"0 ({VERDICT_OF_EXIT[0]})":
        print(f"note: the honest bundle (the control) did not replicate: exit {rows[0][1]}")
    print(f"failures: {len(failures)}" + "".join(f"\n  {f}" for f in failures))
    return 1 if failures else 0


@benchmark(
    "zoo", "record architectures built from configs (HF GPT-2 small through labels=, ...) and replay them"
)
def bench_zoo(rest: list[str]) -> int:
    """Record each model of :mod:`detrl.testing.zoo` for ``--steps`` verifiable steps on this machine, then
    replay the bundle on each of ``--profiles``, with its log and, where that replay corrected elements,
    emptied of it: seconds per recorded and replayed step, the elements each replay's log corrected (this
    machine's own nearest rounding differed from the recorder's: without the log its bits differ there),
    and whether each replay replicates (or the step it diverges at). ``--width/--seq/--batch/--vocab`` size
    the small models (:class:`detrl.testing.zoo.Size`); the full-size ones have their own."""
    from detrl import Divergence
    from detrl.testing import zoo

    p = argparse.ArgumentParser(prog="detrl bench zoo")
    p.add_argument("--models", default="hf_gpt2_small", help="comma-separated, of: " + ",".join(
        [*zoo.SPECIMENS, *zoo.FULL_SIZE]))  # fmt: skip
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--profiles", "--profile", default="emulated:splitk", help="comma-separated replay profiles"
    )
    p.add_argument("--no-strip", action="store_true", help="skip the replays emptied of their log")
    p.add_argument("--width", type=int, default=zoo.Size.width, help="hidden size of the small models")
    p.add_argument("--seq", type=int, default=zoo.Size.seq, help="tokens a sequence")
    p.add_argument("--batch", type=int, default=zoo.Size.batch, help="sequences or images a batch")
    p.add_argument("--vocab", type=int, default=zoo.Size.vocab, help="token vocabulary")
    p.add_argument("--image", type=int, default=zoo.Size.image, help="image side in pixels")
    args = p.parse_args(rest)
    size = zoo.Size(width=args.width, seq=args.seq, batch=args.batch, vocab=args.vocab, image=args.image)
    every = {**zoo.specimens(size), **zoo.FULL_SIZE}
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in every]
    if unknown:
        raise ValueError(f"unknown zoo models {unknown}; known: {', '.join(every)}")
    profiles = [h for h in args.profiles.split(",") if h]
    for h in profiles:
        get_profile(h)  # an unknown profile is one line before any recording
    torch.set_num_threads(1)
    print(machine_line(1))
    print(f"small models at {size}; {args.steps} steps recorded on native (this machine), step 1 calibrates")
    rows = []
    with tempfile.TemporaryDirectory(prefix="detrl-zoo-") as tmp:
        for name in names:
            s = every[name]
            if not zoo.available(s):
                print(f"{name}: skipped (transformers has no {s.needs})")
                continue
            run, nolog = Path(tmp) / name, Path(tmp) / f"{name}-nolog"
            progress(f"zoo: recording {name}")
            t0 = time.perf_counter()
            rec = zoo.record(s, run, steps=args.steps)
            t_rec = (time.perf_counter() - t0) / args.steps
            log = _log_sizes(rec.log_bytes[-args.steps :])
            for hw in profiles:
                progress(f"zoo: replaying {name} on {hw}")
                t0 = time.perf_counter()
                try:
                    corrected = str(zoo.replay(s, run, hw, steps=args.steps).totals.corrected)
                    verdict = "replicates"
                except Divergence as e:
                    corrected, verdict = "-", f"diverges at {e.step}"
                t_rep = (time.perf_counter() - t0) / args.steps
                without = "-"
                if not args.no_strip and corrected not in ("0", "-"):
                    if not nolog.exists():
                        strip_log(run, nolog)
                    try:
                        zoo.replay(s, nolog, hw, steps=args.steps)
                        without = "replicates"
                    except Divergence as e:
                        without = f"diverges at {e.step}"
                rows.append([name, f"{rec.totals.logged:,}", log, f"{t_rec:.1f}", hw, f"{t_rep:.1f}", verdict,
                             corrected, without])  # fmt: skip
            shutil.rmtree(run, ignore_errors=True)
            shutil.rmtree(nolog, ignore_errors=True)
    headers = ["model", "logged", "log KB step 1 / later", "record s/step", "profile", "replay s/step",
               "with log", "corrected", "without log"]  # fmt: skip
    print(table(headers, rows))
    print(
        "log KB: the rounding log's bytes on disk (segment headers included) of the calibrating step 1, and "
        "the mean of the later steps; without log: replayed only where the log corrected elements ('-': it "
        "corrected none, or --no-strip)"
    )
    return 0


def _log_sizes(per_step: list[int]) -> str:
    """``step 1 / later``: step 1's log KB and the later steps' mean (``step 1`` alone for one step)."""
    first = f"{per_step[0] / 1e3:.1f}" if per_step else "-"
    if len(per_step) < 2:
        return first
    return f"{first} / {statistics.mean(per_step[1:]) / 1e3:.1f}"


@benchmark("islands", "step time of models with float32 islands against their FP64 twins, side by side")
def bench_islands(rest: list[str]) -> int:
    """Record each model of :func:`detrl.testing.zoo.fp64_twins` and its FP64 twin (the same model without
    the float32 upcast) in verifiable precision, interleaved, ``--repeats`` times ``--steps`` steps each; the
    median step time (the calibration step excluded) of each and their ratio."""
    from detrl.testing import zoo

    p = argparse.ArgumentParser(prog="detrl bench islands")
    p.add_argument("--models", default="upcast_mlp,hf_gpt2", help="comma-separated, of: upcast_mlp,hf_gpt2")
    p.add_argument("--steps", type=int, default=6, help="steps a recording (the first, calibration, untimed)")
    p.add_argument("--repeats", type=int, default=3, help="recordings of each model, interleaved")
    p.add_argument("--width", type=int, default=256, help="hidden size (zoo.Size.width)")
    p.add_argument("--seq", type=int, default=64, help="tokens a sequence")
    p.add_argument("--batch", type=int, default=8, help="sequences a batch (the MLP: 4x rows)")
    p.add_argument("--vocab", type=int, default=4096, help="token vocabulary")
    args = p.parse_args(rest)
    if args.steps < 2 or args.repeats < 1:
        raise ValueError("--steps must be at least 2 and --repeats at least 1")
    size = zoo.Size(width=args.width, seq=args.seq, batch=args.batch, vocab=args.vocab)
    twins = zoo.fp64_twins(size)
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in twins]
    if unknown:
        raise ValueError(f"unknown models {unknown}; known: {', '.join(twins)}")
    torch.set_num_threads(1)
    print(machine_line(1))
    print(f"size: {size}; {args.repeats} x {args.steps} steps each, interleaved, recorded on native")
    rows = []
    with tempfile.TemporaryDirectory(prefix="detrl-islands-") as tmp:
        for name in names:
            pair = twins[name]
            if not all(zoo.available(s) for s in pair):
                print(f"{name}: skipped (transformers lacks {pair[0].needs})")
                continue
            times: dict[str, list[float]] = {s.name: [] for s in pair}
            for r in range(args.repeats):
                for s in pair:
                    progress(f"islands: {s.name} repeat {r + 1}/{args.repeats}")
                    run = Path(tmp) / f"{s.name}-{r}"
                    session = zoo.record(s, run, steps=args.steps)
                    times[s.name] += session.step_seconds[1:]
                    shutil.rmtree(run, ignore_errors=True)
            island, twin = (statistics.median(times[s.name]) * 1e3 for s in pair)
            rows.append([name, pair[1].name, f"{island:.1f}", f"{twin:.1f}", f"{island / twin:.2f}x"])
    print(table(["island model", "FP64 twin", "island ms/step", "twin ms/step", "island / twin"], rows))
    return 0


@benchmark(
    "steering", "how far a trainer that steers every logged rounding moves the model, and what audits see"
)
def bench_steering(rest: list[str]) -> int:
    """Record the digits CNN honestly and with each steering policy (:mod:`detrl.testing.steering`), and two
    honest runs that differ from the first in one source (one bit of one initial weight; the data order);
    report per step how far each run's weights and held-out loss and accuracy are from the honest run's,
    the elements steered per step, and each steered bundle's audit on ``--profile`` (it replicates: the log
    cannot stop steering) and on its own declared profile (where the corrections flag it)."""
    import numpy as np

    from detrl.run import config as config_mod
    from detrl.testing import steering

    p = argparse.ArgumentParser(prog="detrl bench steering", description=bench_steering.__doc__)
    p.add_argument("--steps", type=int, default=100, help="training steps of every run")
    p.add_argument("--holdout", type=int, default=297, help="digits held out (the target and the metrics)")
    p.add_argument(
        "--policies", default="adversarial,other,random", help="steering policies, comma-separated"
    )
    p.add_argument(
        "--profile", default="emulated:splitk", help="the other profile the steered bundles audit on"
    )
    p.add_argument("--points", default="1,10", help="steps reported besides the last, comma-separated")
    p.add_argument("--out", type=Path, default=None, help="write a PNG of weight distance against step")
    args = p.parse_args(rest)
    policies = [q.strip() for q in args.policies.split(",") if q.strip()]
    for q in policies:
        if q not in steering.POLICIES or q == "nearest":
            raise ValueError(f"unknown steering policy {q!r}; known: {', '.join(steering.POLICIES[1:])}")
    get_profile(args.profile)
    points = sorted({int(q) for q in args.points.split(",") if q.strip()} | {args.steps})
    if args.steps < 1 or points[0] < 1:
        raise ValueError("--steps and every --points must be at least 1")
    points = [q for q in points if q <= args.steps]
    base = [f"train.steps={args.steps}", f"data.holdout={args.holdout}", "verify.checkpoint_every=0"]
    runs: dict[str, tuple[list[str], str]] = {
        "honest": ([], "nearest"),
        **{q: ([], q) for q in policies},
        "ref: one-bit flip": (["sources.bitflip=true"], "nearest"),
        "ref: data order": (["sources.data_order.seed=1"], "nearest"),
    }
    cfg0 = config_mod.load("configs/supervised/digits_cnn.yaml", base)
    torch.set_num_threads(cfg0.threads)
    print(machine_line(cfg0.threads))
    print(
        f"digits_cnn (configs/supervised/digits_cnn.yaml), {args.holdout} digits held out, {args.steps} steps, "
        f"recorded on {cfg0.hardware}; distances and deltas against the honest run at the same step"
    )
    done: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="detrl-steering-") as tmp:
        for name, (extra, policy) in runs.items():
            t0 = time.perf_counter()
            cfg = config_mod.load("configs/supervised/digits_cnn.yaml", base + extra)
            done[name] = steering.record_steered(
                cfg, Path(tmp) / name.replace(" ", "_").replace(":", ""), policy
            )
            progress(f"steering: recorded {name} ({time.perf_counter() - t0:.0f} s)")
        audits = {}
        for q in policies:
            for prof in (args.profile, cfg0.hardware):
                audits[q, prof] = audit(done[q].dir, prof)
                progress(f"steering: audited {q} on {prof}: {audits[q, prof].verdict}")
    honest = done["honest"]
    w_norm = [float(np.linalg.norm(w)) for w in honest.params]
    distance = {
        name: [float(np.linalg.norm(a - b)) for a, b in zip(s.params, honest.params, strict=True)]
        for name, s in done.items()
    }
    rows = []
    for name, s in done.items():
        for step in points:
            d, dl = distance[name][step], s.heldout_loss[step] - honest.heldout_loss[step]
            da = s.heldout_accuracy[step] - honest.heldout_accuracy[step]
            rows.append([
                name if step == points[0] else "", str(step), f"{d:.3g}", f"{d / w_norm[step]:.2g}",
                f"{s.heldout_loss[step]:.6f}", f"{dl:+.2g}", f"{s.heldout_accuracy[step]:.4f}", f"{da:+.4f}",
            ])  # fmt: skip
    print(table(
        ["run", "step", "weight L2", "relative L2", "held-out loss", "d loss", "accuracy", "d acc."], rows
    ))  # fmt: skip
    print()
    rows = []
    for q in policies:
        mode, t = done[q].rounding, done[q].totals
        other, own = audits[q, args.profile], audits[q, cfg0.hardware]
        rows.append([
            q, f"{t.logged / args.steps:,.0f}", f"{statistics.mean(mode.steered):,.0f}",
            f"{t.logged / max(t.rounded_elements, 1):.2e}",
            f"{other.verdict} ({other.corrected:,} corr.)",
            f"{own.verdict} ({own.corrected:,} corr.)" + (
                f", flagged at step {own.steering_first_step}" if own.steering_suspected else ", not flagged"
            ),
        ])  # fmt: skip
    print(table(
        ["policy", "logged/step", "steered/step", "logged/rounded", f"audit on {args.profile}",
         f"audit on {cfg0.hardware} (declared)"], rows,
    ))  # fmt: skip
    print(
        f"weight L2: ||w - w_honest|| over all parameters (||w_honest|| = {w_norm[-1]:.3g} at step {args.steps}); "
        "steered: logged elements rounded to the other FP32 neighbour (one spacing each)"
    )
    if args.out is not None:
        _plot_steering(args.out, distance, args.steps)
        print(f"plot: {args.out}")
    return 0


def _plot_steering(out: Path, distance: dict[str, list[float]], steps: int) -> None:
    """Weight distance to the honest run against step (log scale), one line per run, to ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2))
    ax = fig.add_subplot()
    for name, d in distance.items():
        if name == "honest":
            continue
        ref = name.startswith("ref:")
        ax.plot(range(1, steps + 1), d[1:], ls="--" if ref else "-", lw=1.5, label=name)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("||w - w_honest||  (L2, all parameters)")
    ax.set_title("digits CNN: steered runs and honest references against the honest run")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


@benchmark(
    "dispute", "settle a dispute over a long run with one cheated step: comparisons, bytes, referee time"
)
def bench_dispute(rest: list[str]) -> int:
    """Record the digits CNN (shrunk with ``--set``) for ``--steps`` steps honestly, and again with the loss
    of ``--cheat-step`` scaled by 1.001 (:func:`detrl.testing.cheats.scaled_loss`), then settle the dispute
    between them (:mod:`detrl.apps.dispute`; the cheating party re-executes with its cheat when asked):
    commitment comparisons against their bound, messages and bytes exchanged, the referee's replay time,
    the parties' re-execution time, and the blamed op. Then the cost of per-op digests: the same steps
    replayed with every step traced and with none, interleaved."""
    import contextlib

    from detrl.apps.dispute import Channel, Party, Referee
    from detrl.run import config as config_mod
    from detrl.testing.cheats import cheating_reexecute, scaled_loss

    p = argparse.ArgumentParser(prog="detrl bench dispute", description=bench_dispute.__doc__)
    p.add_argument("--steps", type=int, default=1000, help="steps of both recordings")
    p.add_argument("--cheat-step", type=int, default=0, help="the cheated step (default: 2/3 of --steps)")
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config overrides (model.channels=8)"
    )
    p.add_argument("--referee", default="native", help="the referee's profile")
    p.add_argument(
        "--digest-steps", type=int, default=20, help="steps replayed for the digest cost (0: skip)"
    )
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of the digest cost replays")
    args = p.parse_args(rest)
    args.set = args.set or ["model.channels=8"]  # a shrunk CNN: 1,000 steps record in well under a minute
    cheat = args.cheat_step or max(1, 2 * args.steps // 3)
    if not 1 <= cheat <= args.steps:
        raise ValueError(f"--cheat-step must lie in 1..--steps ({args.steps}), not {cheat}")
    overrides = [*args.set, f"train.steps={args.steps}", f"verify.checkpoint_every={args.checkpoint_every}"]
    cfg = config_mod.load("configs/supervised/digits_cnn.yaml", overrides)
    torch.set_num_threads(1)
    print(machine_line(1))
    print(
        f"digits_cnn ({', '.join(args.set)}), {args.steps} steps, checkpoints every {args.checkpoint_every}; "
        f"bundle B scales the loss of step {cheat} by 1.001; referee on {args.referee}"
    )
    with tempfile.TemporaryDirectory(prefix="detrl-dispute-") as tmp:
        honest, cheated = Path(tmp) / "A", Path(tmp) / "B"
        for run, how in ((honest, contextlib.nullcontext()), (cheated, scaled_loss(cheat, 1.001))):
            t0 = time.perf_counter()
            with how:
                record(cfg, run)
            progress(f"recorded {run.name}: {args.steps} steps in {time.perf_counter() - t0:.0f} s")
        party_seconds = [0.0]
        cheater = cheating_reexecute(cheat, 1.001)

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return cheater(*a, **kw)
            finally:
                party_seconds[0] += time.perf_counter() - t0

        a, b = Channel("A", Party(honest)), Channel("B", Party(cheated, reexecute=timed))
        t0 = time.perf_counter()
        v = Referee(a, b, honest, cheated, args.referee, progress=progress).settle()
        total = time.perf_counter() - t0
        digest_rows = _digest_cost(cfg, honest, args.digest_steps, args.repeats)
    print(table(
        ["first differing step", "comparisons (bound)", "messages", "bytes exchanged", "replayed from",
         "referee replay s", "party re-exec s", "total s", "reproduces"],
        [[str(v.step), f"{v.comparisons} ({v.comparison_bound})", str(v.messages), f"{v.bytes_exchanged:,}",
          f"step {v.replay_from}", f"{v.replay_seconds:.2f}", f"{party_seconds[0]:.2f}", f"{total:.1f}",
          str(v.reproduces)]],
    ))  # fmt: skip
    for blame in v.blamed:
        print(f"blamed: {blame.describe()}")
    if digest_rows:
        print(table(["per-op digests", "ops/step", "ms/step (median)", "cost/step"], digest_rows))
    ok = v.step == cheat and v.reproduces == "A" and v.comparisons <= v.comparison_bound
    return 0 if ok else 1


def _digest_cost(cfg: Any, run: Path, steps: int, repeats: int) -> list[list[str]]:
    """Replay steps 1..``steps`` of ``run`` with every step's per-op digests on, and with them off,
    interleaved ``repeats`` times: median step time of each (the first step excluded) and the difference."""
    import contextlib

    from detrl.core.engine import Session
    from detrl.core.optrace import OpTrace
    from detrl.run import sessions, tasks

    if steps < 2:
        return []

    class EveryStep(Session):
        traced = False
        ops = 0

        @contextlib.contextmanager
        def step(self, batch: Any = None, frozen: bool = False) -> Any:
            trace = self.rounding.trace = OpTrace() if self.traced else None
            try:
                with super().step(batch, frozen) as rounding:
                    yield rounding
            finally:
                self.rounding.trace = None
                self.ops = len(trace.records) if trace is not None else self.ops

    times: dict[bool, list[float]] = {False: [], True: []}
    ops = 0
    for r in range(repeats):
        for traced in (False, True):
            progress(f"digest cost: repeat {r + 1}/{repeats}, {'traced' if traced else 'untraced'}")
            s = sessions.session_for(cfg, run, "replay", session_type=EveryStep, stop=steps)
            assert isinstance(s, EveryStep)
            s.traced = traced
            with s:
                tasks.get(cfg.task).run(cfg, s)
            times[traced] += s.step_seconds[1:]
            ops = max(ops, s.ops)
    off, on = (statistics.median(times[k]) * 1e3 for k in (False, True))
    return [
        ["off", "", f"{off:.2f}", ""],
        ["on (every step)", str(ops), f"{on:.2f}", f"+{on - off:.2f} ms ({100 * (on - off) / off:.0f} %)"],
    ]
