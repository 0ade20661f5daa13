"""Settle a dispute between two bundles of one config: find where they part, replay that step, blame an op.

The protocol of verifiable training (Srivastava, Arora & Boneh 2024): a trainer and an auditor each hold a
bundle of the same config, and their Merkle roots differ. A :class:`Referee` talks to each :class:`Party`
only through byte messages (:class:`Channel` counts them), so the parties can sit in other processes or on
other machines; it holds copies of both bundles to replay from.

1. Both parties state their config (different configs are bad input) and their root and leaf count.
2. The referee walks down both Merkle trees from the roots: at each node it asks each party for the two
   children (checked against the node: ``commit.node(left, right)``), compares the left children and goes
   to the leftmost pair that differs. That is a binary search over the leaves whose every probe compares
   the commitment of a whole range of steps, so it finds the *first* step ``s`` whose commitments differ,
   even where a later one agrees again (an overwritten commitment), in at most ``ceil(log2 n)``
   comparisons; the revealed leaves of ``s`` (state and batch hash, checked against their leaf) are one
   more. ``s = 0`` is a dispute over the initial state.
3. The referee replays step ``s`` of each bundle on its own profile from the last checkpoint both hold
   before it (steps ``c+1..s-1`` must match, as in an audit), with per-op digests on
   (:mod:`detrl.core.optrace`), and checks which party's leaf ``s`` it reproduces.
4. For a party it does not reproduce, it asks that party to re-execute step ``s`` and reveal its per-op
   digests, compares them with its own under that party's log, and names the first op that departs
   (position, aten op, module path); then asks for that op's output values and names the first element
   that differs, where the party reveals them.

Exit codes of ``detrl dispute``: 0 no dispute (equal roots), 1 a dispute settled (the verdict names the
bundle the referee reproduces and blames the other, or both), 2 bad input (one line).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from detrl.apps.audit import config_failures_are_bad_input, prepare_replay
from detrl.core.engine import Divergence, Session
from detrl.core.hardware import get_profile, profile_names
from detrl.core.optrace import OpDigest, OpTrace
from detrl.formats import bundle as bundle_mod
from detrl.formats import commit, safeio
from detrl.formats.bundle import BundleError
from detrl.formats.roundlog import RoundLogError
from detrl.run import sessions

EXIT_CODES = {"no dispute": 0, "settled": 1, "bad input": 2}
#: The largest message the referee reads from a party (a revealed op output is the largest).
MAX_MESSAGE_BYTES = 256 << 20
#: Config keys two bundles of "one config" may differ in: the recorder's machine, not the run.
MACHINE_KEYS = ("hardware", "hardware_seed", "threads")
#: Bounds on what a party's digest list may hold (ops in a step, characters of a name or module path).
MAX_OPS = 1 << 22
MAX_NAME = 512


# ---------------------------------------------------------------------------------------------- replay
class _Reached(Exception):
    """The replay reached the step it was asked for (raised to end a replay of step 0 after ``init``)."""


class StepTracer(Session):
    """A replaying Session that traces the ops of one step (``traced_step``) into ``trace``: the rounding
    mode's per-op digests are on for that step only. It observes: nothing enters a commitment."""

    traced_step: int = -1
    trace: OpTrace | None = None

    @contextlib.contextmanager
    def step(self, batch: Any = None, frozen: bool = False) -> Any:
        tracing = self.trace is not None and self.step_index + 1 == self.traced_step
        if tracing:
            self.rounding.trace = self.trace
        try:
            with super().step(batch, frozen) as rounding:
                yield rounding
        finally:
            if tracing:
                self.rounding.trace = None

    def on_commit(self, step: int, frozen: bool) -> None:
        if step == 0 and self.traced_step == 0:
            raise _Reached


@dataclasses.dataclass
class StepReplay:
    """A replay of one bundle up to step ``step`` (from the checkpoint of step ``start``).

    ``reproduced``: every commitment through ``step`` matched. ``diverged_at``: the step whose commitment
    the replay did not reproduce (``step`` itself, or an earlier one). ``trace``: the ops of ``step`` with
    their digests, when the replay ran them (None when it diverged before). ``seconds``: wall time.
    """

    step: int
    start: int
    reproduced: bool
    diverged_at: int | None
    message: str
    trace: OpTrace | None
    seconds: float


def replay_step(
    run_dir: str | Path,
    step: int,
    hardware: str = "native",
    *,
    keep: frozenset[int] | bool = False,
    start: int | None = None,
    data: Path | None = None,
    init_from: Path | None = None,
    caps: Mapping[str, float] | None = None,
) -> StepReplay:
    """Replay ``run_dir`` on ``hardware`` from its checkpoint of step ``start`` (default: the last one
    before ``step``; 0: from the initial state) through ``step``, with the per-op digests of ``step`` on.

    ``keep``: positions of ``step`` whose outputs are copied into the trace (``True``: all, within the
    trace's budget). The config is checked as ``detrl audit`` checks it (caps, seeds, ``data`` and
    ``init_from``: the replayer's own copies). Bad input raises :class:`BundleError`.
    """
    run_dir = Path(run_dir)
    t0 = time.perf_counter()
    plan = prepare_replay(run_dir, caps, data, init_from)
    task, cfg, extra = plan.task, plan.cfg, plan.extra
    if not 0 <= step <= plan.bundle.steps:
        raise BundleError(
            f"{run_dir}: step {step} is outside the bundle's durable steps 0..{plan.bundle.steps}"
        )
    if start is None:
        start = max([0, *(c for c in plan.bundle.checkpoint_steps if c < step)])
    if not plan.same_data:
        return StepReplay(
            step, start, False, 0, "the data fingerprint differs from the replayer's data", None, 0.0
        )
    segment: dict[str, Any] = {"start": start, "stop": step} if step > 0 else {}
    session = sessions.session_for(
        cfg, run_dir, "replay", hardware=hardware, fingerprint=plan.ours, session_type=StepTracer, **segment
    )
    assert isinstance(session, StepTracer)
    trace = OpTrace(keep=keep)
    session.traced_step, session.trace = step, trace
    diverged, message = None, f"reproduced every commitment through step {step}"
    try:
        with config_failures_are_bad_input(), session:
            task.run(cfg, session, data=data, **extra)
    except _Reached:
        pass
    except Divergence as d:
        diverged, message = d.step, d.describe()
    ran_step = diverged is None or diverged >= step
    return StepReplay(
        step,
        start,
        diverged is None,
        diverged,
        message,
        trace if ran_step and step > 0 else None,
        time.perf_counter() - t0,
    )


# ---------------------------------------------------------------------------------------------- messages
def encode(obj: Mapping[str, Any]) -> bytes:
    """A message's bytes: compact JSON, sorted keys (binary fields are hex or base64 strings)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def decode(data: bytes, what: str) -> dict[str, Any]:
    """A message from untrusted bytes: bounded, strict JSON, an object (else :class:`BundleError`)."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise BundleError(f"{what}: a message of {len(data)} bytes, more than {MAX_MESSAGE_BYTES}")
    try:
        obj = safeio.loads_json(data, what, max_depth=8)
    except safeio.UnsafeInput as e:
        raise BundleError(str(e)) from None
    if not isinstance(obj, dict):
        raise BundleError(f"{what}: not a message object")
    return obj


def _field(msg: Mapping[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = msg.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise BundleError(f"{what}: field {key!r} missing or of the wrong type")
    return value


def _digest(msg: Mapping[str, Any], key: str, what: str) -> bytes:
    text = _field(msg, key, str, what)
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raw = b""
    if len(raw) != commit.DIGEST_BYTES:
        raise BundleError(f"{what}: field {key!r} is not a {commit.DIGEST_BYTES}-byte hex digest")
    return raw


class Handler(Protocol):
    def handle(self, request: bytes) -> bytes: ...


class Channel:
    """The referee's end of one party's byte pipe: :meth:`ask` sends a request and parses the answer,
    counting messages and bytes both ways. ``handler`` maps request bytes to response bytes (a
    :class:`Party` here; a socket or a subprocess elsewhere)."""

    def __init__(self, name: str, handler: Handler | Callable[[bytes], bytes]) -> None:
        self.name = name
        self._send = handler.handle if hasattr(handler, "handle") else handler  # type: ignore[union-attr]
        self.sent = self.received = self.messages = 0

    def ask(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Send request ``kind`` with ``fields``; the answer, a parsed message (an error answer from the
        party, or a malformed one, is :class:`BundleError` naming the party)."""
        request = encode({"ask": kind, **fields})
        response = self._send(request)
        self.sent += len(request)
        self.received += len(response)
        self.messages += 1
        msg = decode(response, f"party {self.name}: {kind} answer")
        if "error" in msg:
            raise BundleError(f"party {self.name}: {str(msg['error'])[:300]}")
        return msg

    @property
    def bytes(self) -> int:
        return self.sent + self.received


# ---------------------------------------------------------------------------------------------- the party
Reexecute = Callable[..., StepReplay]


class Party:
    """One side of a dispute: a bundle, and the code that re-executes one of its steps.

    Answers requests (:meth:`handle`, bytes in and out): ``config``, ``root`` (Merkle root and leaf
    count), ``node`` (the children of a Merkle node), ``leaf`` (a step's state and batch hash), ``log``
    (a step's rounding-log segment), ``ops`` (the per-op digests of a step, re-executed on request) and
    ``values`` (one op's output values, re-executed). ``reexecute`` has :func:`replay_step`'s signature
    (the default: an honest party replays its own bundle on ``hardware``); a test plays a dishonest one
    by passing its own.
    """

    def __init__(
        self,
        run_dir: str | Path,
        hardware: str = "native",
        *,
        reexecute: Reexecute | None = None,
        data: Path | None = None,
        init_from: Path | None = None,
        caps: Mapping[str, float] | None = None,
    ) -> None:
        self.dir = Path(run_dir)
        self.hardware = hardware
        self.reexecute = reexecute or replay_step
        self.options: dict[str, Any] = {"data": data, "init_from": init_from, "caps": caps}
        b = bundle_mod.Bundle(self.dir)
        b.close()
        self.manifest, self.checkpoints = b.manifest, list(b.checkpoint_steps)
        self.leaves = [commit.leaf(i, s, h) for i, (s, h) in enumerate(b.leaves)]
        self.state_batch = b.leaves
        self.levels = commit.merkle_levels(self.leaves or [commit.merkle_root([])])
        self._replays: dict[tuple[int, Any], StepReplay] = {}

    def handle(self, request: bytes) -> bytes:
        """Answer one request; a request it cannot answer gets ``{"error": "..."}``, never an exception."""
        try:
            msg = decode(request, "request")
            kind = msg.get("ask")
            answer = getattr(self, f"_ask_{kind}", None) if isinstance(kind, str) else None
            if answer is None:
                raise BundleError(f"unknown request {str(kind)[:40]!r}")
            return encode(answer(msg))
        except (BundleError, RoundLogError, ValueError) as e:
            return encode({"error": " ".join(str(e).split())[:300]})

    def _step(self, msg: Mapping[str, Any], low: int = 0) -> int:
        step = _field(msg, "step", int, "request")
        if not low <= step < len(self.leaves):
            raise BundleError(f"step {step} is outside {low}..{len(self.leaves) - 1}")
        return step

    def _ask_config(self, msg: Mapping[str, Any]) -> dict[str, Any]:
        m = self.manifest
        return {
            "task": m.task,
            "config": m.config,
            "precision": m.precision,
            "data_fingerprint": m.data_fingerprint,
            "checkpoints": self.checkpoints,
        }

    def _ask_root(self, msg: Mapping[str, Any]) -> dict[str, Any]:
        return {"root": self.levels[-1][0].hex(), "leaves": len(self.leaves)}

    def _ask_node(self, msg: Mapping[str, Any]) -> dict[str, Any]:
        level, index = _field(msg, "level", int, "request"), _field(msg, "index", int, "request")
        if not 1 <= level < len(self.levels) or not 0 <= index < len(self.levels[level]):
            raise BundleError(f"no Merkle node ({level}, {index})")
        below = self.levels[level - 1]
        return {"children": [h.hex() for h in below[2 * index : 2 * index + 2]]}

    def _ask_leaf(self, msg: Mapping[str, Any]) -> dict[str, Any]:
        step = self._step(msg)
        state, batch = self.state_batch[step]
        return {"step": step, "state": state.hex(), "batch": batch.hex()}

    def _ask_log(self, msg: Mapping[str, Any]) -> dict[str, Any]:
        step = self._step(msg, low=1)
        b = bundle_mod.Bundle(self.dir)
        try:
            reader = b.roundlog
            if reader is None:
                return {"step": step, "segment": ""}
            size = reader.segment_bytes(step)
            raw = reader.raw_bytes(reader.segment_end(step) - size, size)
        finally:
            b.close()
        return {"step": step, "segment": base64.b64encode(raw).decode()}

    def _replay(self, step: int, keep: frozenset[int] | bool) -> StepReplay:
        key = (step, keep)
        if key not in self._replays:
            self._replays[key] = self.reexecute(self.dir, step, self.hardware, keep=keep, **self.options)
        return self._replays[key]

    def _ask_ops(self, msg: Mapping[str, Any]) -> dict[str, Any]:
        step = self._step(msg, low=1)
        r = self._replay(step, False)
        if r.trace is None:
            raise BundleError(f"re-executing step {step} stopped before it: {r.message[:200]}")
        ops = [[d.op, d.module, d.digest.hex()] for d in r.trace.records]
        return {"step": step, "reproduced": r.reproduced, "ops": ops}

    def _ask_values(self, msg: Mapping[str, Any]) -> dict[str, Any]:
        step = self._step(msg, low=1)
        position = _field(msg, "position", int, "request")
        r = self._replay(step, frozenset({position}))
        kept = r.trace.kept.get(position) if r.trace is not None else None
        if kept is None:
            raise BundleError(f"step {step} has no op at position {position} (or its output is too large)")
        return {"step": step, "position": position, "outputs": [_tensor_message(t) for t in kept]}


_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def _tensor_message(t: torch.Tensor) -> dict[str, Any]:
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()  # little-endian
    dtype = str(t.dtype).removeprefix("torch.")
    return {"dtype": dtype, "shape": list(t.shape), "data": base64.b64encode(raw).decode()}


def _tensor_from(msg: Any, what: str) -> torch.Tensor:
    """A revealed tensor, every length checked before anything is allocated."""
    if not isinstance(msg, dict):
        raise BundleError(f"{what}: not a tensor")
    dtype = _DTYPES.get(_field(msg, "dtype", str, what))
    shape = _field(msg, "shape", list, what)
    if dtype is None or len(shape) > 8 or not all(isinstance(d, int) and 0 <= d < 1 << 40 for d in shape):
        raise BundleError(f"{what}: an unsupported dtype or shape")
    numel = math.prod(shape)
    data = _field(msg, "data", str, what)
    if len(data) > MAX_MESSAGE_BYTES or len(data) != 4 * math.ceil(numel * dtype.itemsize / 3):
        raise BundleError(f"{what}: data of the wrong length for its shape")
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError:
        raise BundleError(f"{what}: data is not base64") from None
    if len(raw) != numel * dtype.itemsize:
        raise BundleError(f"{what}: data of the wrong length for its shape")
    return (
        torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)
        if numel
        else torch.empty(shape, dtype=dtype)
    )


# ---------------------------------------------------------------------------------------------- the verdict
@dataclasses.dataclass
class Blame:
    """Where a bundle the referee does not reproduce departs from the referee's computation of step
    ``step`` under that bundle's own log.

    ``position``: the first op (0-based, over the step's rounded ops) whose digest differs, or None when
    every op agrees (the committed state is one no execution of these ops gives) or the party revealed
    none. ``op``/``module``: that op as the party names it; ``referee_op``/``referee_module``: the
    referee's op at that position. ``element``: the first differing element (row-major index in output
    ``output``), with both values, when the party revealed the op's outputs and they have one shape.
    """

    party: str
    step: int
    position: int | None = None
    op: str = ""
    module: str = ""
    referee_op: str = ""
    referee_module: str = ""
    output: int | None = None
    element: int | None = None
    party_value: float | None = None
    referee_value: float | None = None
    detail: str = ""

    def describe(self) -> str:
        if self.position is None:
            return f"bundle {self.party}: {self.detail}"
        where = f"op #{self.position} aten.{self.op or '(none)'}" + (
            f" in {self.module}" if self.module else ""
        )
        ref = f"aten.{self.referee_op or '(none)'}" + (
            f" in {self.referee_module}" if self.referee_module else ""
        )
        text = f"bundle {self.party}: first departs at {where} (the referee has {ref} there)"
        if self.element is not None:
            text += (
                f", output {self.output} element {self.element}: {self.party_value!r} where the referee has "
                f"{self.referee_value!r}"
            )
        return text + (f"; {self.detail}" if self.detail else "")


@dataclasses.dataclass
class Verdict:
    """What ``detrl dispute`` prints and writes with ``--json``.

    ``outcome``: ``no dispute`` (equal roots) or ``settled``. ``step``: the first step whose commitments
    differ. ``comparisons``: commitments compared to find it (at most ``comparison_bound`` =
    ceil(log2 leaves) + 1). ``bytes_exchanged``/``messages``: both channels, both ways.
    ``replay_seconds``: the referee's replays. ``reproduces``: ``A``, ``B``, ``both`` or ``neither``.
    """

    run_a: str
    run_b: str
    referee: str
    outcome: str
    message: str
    leaves: int = 0
    step: int | None = None
    comparisons: int = 0
    comparison_bound: int = 0
    batch_differs: bool = False
    logs_identical: bool | None = None
    replay_from: int | None = None
    replay_seconds: float = 0.0
    reproduces: str | None = None
    blamed: list[Blame] = dataclasses.field(default_factory=list)
    bytes_exchanged: int = 0
    messages: int = 0

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.outcome]

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["exit_code"] = self.exit_code
        return d


# ---------------------------------------------------------------------------------------------- the referee
class Referee:
    """Drives a dispute between parties ``a`` and ``b`` (:class:`Channel`) over the bundles ``run_a`` and
    ``run_b`` (the referee's copies, which it replays on ``hardware``)."""

    def __init__(
        self,
        a: Channel,
        b: Channel,
        run_a: str | Path,
        run_b: str | Path,
        hardware: str = "native",
        *,
        data: Path | None = None,
        init_from: Path | None = None,
        caps: Mapping[str, float] | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        get_profile(hardware)  # an unknown profile is bad input now, not after the search
        self.a, self.b = a, b
        self.runs = {a.name: Path(run_a), b.name: Path(run_b)}
        self.hardware = hardware
        self.options: dict[str, Any] = {"data": data, "init_from": init_from, "caps": caps}
        self.progress = progress or (lambda msg: None)

    def settle(self) -> Verdict:
        """Run the protocol (module docstring) and give the verdict. Bad input raises :class:`BundleError`."""
        a, b = self.a, self.b
        v = Verdict(str(self.runs[a.name]), str(self.runs[b.name]), self.hardware, "no dispute", "")
        checkpoints = self._same_config()
        roots = {}
        for party in (a, b):
            msg = party.ask("root")
            roots[party.name] = (
                _digest(msg, "root", f"party {party.name}"),
                _field(msg, "leaves", int, "root"),
            )
            self._check_own_bundle(party.name, *roots[party.name])
        (root_a, n), (root_b, n_b) = roots[a.name], roots[b.name]
        if n != n_b:
            raise BundleError(
                f"the bundles hold {n - 1} and {n_b - 1} durable steps: a dispute compares two recordings of "
                "the same length (continue the shorter one with detrl train --resume)"
            )
        v.leaves, v.comparison_bound = n, math.ceil(math.log2(n)) + 1 if n > 1 else 1
        if root_a == root_b:
            v.message = (
                f"no dispute: both bundles commit to the same {n} leaves (Merkle root {root_a.hex()[:16]})"
            )
            return self._count(v)
        s, v.comparisons = self._first_difference(root_a, root_b, n)
        v.step = s
        leaf = {p.name: p.ask("leaf", step=s) for p in (a, b)}
        v.comparisons += 1
        hashes = {}
        for name, msg in leaf.items():
            state, batch = _digest(msg, "state", f"party {name}"), _digest(msg, "batch", f"party {name}")
            if commit.leaf(s, state, batch) != self._leaf_hashes[name]:
                raise BundleError(f"party {name}: its state and batch hash of step {s} are not its leaf")
            hashes[name] = (state, batch)
        v.batch_differs = hashes[a.name][1] != hashes[b.name][1]
        self.progress(f"first differing step: {s} ({v.comparisons} comparisons)")
        if s > 0:
            v.logs_identical = self._log_segments(s)
        start = max([0, *(c for c in checkpoints if c < s)])
        v.replay_from = start
        replays = {}
        for party in (a, b):
            self.progress(
                f"replaying bundle {party.name} from step {start} through step {s} on {self.hardware}"
            )
            replays[party.name] = replay_step(
                self.runs[party.name], s, self.hardware, keep=True, start=start, **self.options
            )
        v.replay_seconds = sum(r.seconds for r in replays.values())
        good = [name for name, r in replays.items() if r.reproduced]
        v.reproduces = good[0] if len(good) == 1 else "both" if len(good) == 2 else "neither"
        v.outcome = "settled"
        for party in (a, b):
            if party.name not in good:
                v.blamed.append(self._blame(party, replays[party.name], s))
        v.message = self._message(v)
        return self._count(v)

    # -- the steps of the protocol
    def _same_config(self) -> list[int]:
        """Both bundles are of one task config in verifiable precision (else bad input); the checkpoint
        steps both hold."""
        msgs = {p.name: p.ask("config") for p in (self.a, self.b)}
        ma, mb = msgs[self.a.name], msgs[self.b.name]
        for key in ("task", "precision", "data_fingerprint"):
            if ma.get(key) != mb.get(key):
                raise BundleError(
                    f"the bundles are not of one config: {key} differs ({str(ma.get(key))[:40]!r} "
                    f"and {str(mb.get(key))[:40]!r})"
                )
        ca, cb = ma.get("config"), mb.get("config")
        if not isinstance(ca, dict) or not isinstance(cb, dict):
            raise BundleError(
                "the bundles are not task configs (recorded by a script): nothing to replay them from"
            )
        diff = _differing_key(
            {k: v for k, v in ca.items() if k not in MACHINE_KEYS},
            {k: v for k, v in cb.items() if k not in MACHINE_KEYS},
        )
        if diff is not None:
            raise BundleError(f"the bundles are not of one config: config.{diff} differs")
        if ma.get("precision") != "verifiable":
            raise BundleError(
                f"precision {str(ma.get('precision'))[:20]}: a dispute needs verifiable precision "
                "(per-op digests come from its rounding)"
            )
        both = set(_field(ma, "checkpoints", list, "config")) & set(_field(mb, "checkpoints", list, "config"))
        return sorted(c for c in both if isinstance(c, int) and not isinstance(c, bool))

    def _check_own_bundle(self, name: str, root: bytes, n: int) -> None:
        """The root a party states is the one of the bundle copy the referee replays."""
        b = bundle_mod.Bundle(self.runs[name])
        b.close()
        if (
            b.manifest.durable is None
            or bytes.fromhex(b.manifest.durable.merkle_root) != root
            or len(b.leaves) != n
        ):
            raise BundleError(f"party {name}: its root is not the one of its bundle {self.runs[name]}")

    def _first_difference(self, root_a: bytes, root_b: bytes, n: int) -> tuple[int, int]:
        """Walk both Merkle trees from their roots to the leftmost differing leaf: ``(step, comparisons)``.
        Every revealed pair of children is checked against its parent, so a party cannot steer the walk."""
        sizes = [n]
        while sizes[-1] > 1:
            sizes.append((sizes[-1] + 1) // 2)
        nodes = {self.a.name: root_a, self.b.name: root_b}
        index, comparisons = 0, 0
        for level in range(len(sizes) - 1, 0, -1):
            expect = 2 if 2 * index + 1 < sizes[level - 1] else 1
            children = {}
            for party in (self.a, self.b):
                msg = party.ask("node", level=level, index=index)
                raw = _field(msg, "children", list, f"party {party.name}: node")
                if len(raw) != expect:
                    raise BundleError(
                        f"party {party.name}: node ({level}, {index}) has {expect} children, not {len(raw)}"
                    )
                kids = [_digest({"h": h}, "h", f"party {party.name}: node") for h in raw]
                parent = commit.node(*kids) if expect == 2 else kids[0]
                if parent != nodes[party.name]:
                    raise BundleError(
                        f"party {party.name}: the children of node ({level}, {index}) do not hash to it"
                    )
                children[party.name] = kids
            if expect == 2:
                comparisons += 1
                go = 0 if children[self.a.name][0] != children[self.b.name][0] else 1
            else:
                go = 0
            index = 2 * index + go
            nodes = {name: kids[go] for name, kids in children.items()}
        self._leaf_hashes = nodes
        return index, comparisons

    def _log_segments(self, s: int) -> bool:
        """Both parties' rounding-log segments of step ``s`` (each checked against the referee's copy of
        its bundle): whether they are identical."""
        segments = {}
        for party in (self.a, self.b):
            msg = party.ask("log", step=s)
            try:
                raw = base64.b64decode(_field(msg, "segment", str, f"party {party.name}: log"), validate=True)
            except ValueError:
                raise BundleError(f"party {party.name}: its log segment is not base64") from None
            b = bundle_mod.Bundle(self.runs[party.name])
            try:
                reader = b.roundlog
                size = reader.segment_bytes(s) if reader is not None else 0
                own = reader.raw_bytes(reader.segment_end(s) - size, size) if reader is not None else b""
            finally:
                b.close()
            if raw != own:
                raise BundleError(f"party {party.name}: its log segment of step {s} is not its bundle's")
            segments[party.name] = raw
        return segments[self.a.name] == segments[self.b.name]

    def _blame(self, party: Channel, mine: StepReplay, s: int) -> Blame:
        """Where ``party``'s step ``s`` departs from the referee's replay of it under the party's log."""
        blame = Blame(party.name, s)
        if mine.diverged_at is not None and mine.diverged_at < s:
            blame.step = mine.diverged_at
            blame.detail = f"its bundle does not replay to step {s}: {mine.message}"
            return blame
        if s == 0 or mine.trace is None:
            blame.detail = f"the referee does not reproduce its step {s}: {mine.message}"
            return blame
        try:
            msg = party.ask("ops", step=s)
        except BundleError as e:  # a party that reveals nothing is still blamed, without an op
            blame.detail = (
                f"the referee does not reproduce its step {s}, and it revealed no per-op digests ({e})"
            )
            return blame
        ops = _field(msg, "ops", list, f"party {party.name}: ops")
        if len(ops) > MAX_OPS:
            raise BundleError(f"party {party.name}: {len(ops)} ops in one step, more than {MAX_OPS}")
        theirs = [_op_record(i, o, party.name) for i, o in enumerate(ops)]
        ours = mine.trace.records
        p = next(
            (i for i, (t, o) in enumerate(zip(theirs, ours)) if (t.op, t.digest) != (o.op, o.digest)),
            min(len(theirs), len(ours)),
        )
        if p == len(theirs) == len(ours):
            blame.detail = (
                f"its {len(ours)} ops of step {s} all match the referee's, but its commitment does not: the "
                "committed state is not what these ops compute (a commitment no execution gives)"
            )
            return blame
        blame.position = p
        if p < len(theirs):
            blame.op, blame.module = theirs[p].op, theirs[p].module
        if p < len(ours):
            blame.referee_op, blame.referee_module = ours[p].op, ours[p].module
        if p >= len(theirs) or p >= len(ours):
            blame.detail = f"it ran {len(theirs)} ops, the referee {len(ours)}"
            return blame
        self._first_element(party, blame, s, p, mine.trace.kept.get(p))
        return blame

    def _first_element(
        self, party: Channel, blame: Blame, s: int, p: int, ours: list[torch.Tensor] | None
    ) -> None:
        """Ask ``party`` for op ``p``'s outputs and name the first element that differs from ``ours``."""
        try:
            msg = party.ask("values", step=s, position=p)
            raw = _field(msg, "outputs", list, f"party {party.name}: values")
            if len(raw) > 64:
                raise BundleError(f"party {party.name}: {len(raw)} outputs of one op")
            theirs = [_tensor_from(t, f"party {party.name}: values") for t in raw]
        except BundleError as e:
            blame.detail = f"no values revealed ({str(e)[:120]})"
            return
        if ours is None:
            blame.detail = "the referee kept no copy of its own output (over its budget)"
            return
        nan_bits = False  # whether two NaNs differed in their bits
        for k, (t, o) in enumerate(zip(theirs, ours)):
            if t.dtype != o.dtype or t.shape != o.shape:
                blame.detail = (
                    f"output {k}: {t.dtype} {tuple(t.shape)} where the referee has {o.dtype} {tuple(o.shape)}"
                )
                return
            bits = t.reshape(-1).view(_int_of(t)) != o.reshape(-1).view(_int_of(o))
            nans = t.reshape(-1).isnan() & o.reshape(-1).isnan()  # one value: their bits are the hardware's
            nan_bits = nan_bits or bool((bits & nans).any())
            differ = (bits & ~nans).nonzero()
            if len(differ):
                i = int(differ[0, 0])
                blame.output, blame.element = k, i
                blame.party_value, blame.referee_value = float(t.reshape(-1)[i]), float(o.reshape(-1)[i])
                return
        blame.detail = "its revealed outputs equal the referee's (the digest it revealed does not)"
        if nan_bits:
            blame.detail = (
                "its revealed outputs equal the referee's but for NaNs' signs and payloads, which are the "
                "hardware's (from rules revision 13 a digest takes every NaN as one)"
            )

    def _message(self, v: Verdict) -> str:
        who = {"both": "both bundles", "neither": "neither bundle"}.get(
            v.reproduces or "", f"bundle {v.reproduces}"
        )
        text = f"the commitments first differ at step {v.step}"
        if v.step == 0:
            text += " (a dispute over the initial state)"
        if v.batch_differs:
            text += ", where the batch hashes differ too"
        text += f"; replaying it, the referee reproduces {who}"
        if v.reproduces == "both":
            text += " (each log's rounding choices are honoured: the logs differ where rounding is ambiguous)"
        return text

    def _count(self, v: Verdict) -> Verdict:
        v.bytes_exchanged = self.a.bytes + self.b.bytes
        v.messages = self.a.messages + self.b.messages
        return v


def _int_of(t: torch.Tensor) -> torch.dtype:
    return {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()]


def _op_record(position: int, raw: Any, name: str) -> OpDigest:
    what = f"party {name}: ops[{position}]"
    if not isinstance(raw, list) or len(raw) != 3:
        raise BundleError(f"{what}: not [op, module, digest]")
    op, module, digest = raw
    if not isinstance(op, str) or not isinstance(module, str) or len(op) > MAX_NAME or len(module) > MAX_NAME:
        raise BundleError(f"{what}: a bad op name or module path")
    return OpDigest(position, op, module, _digest({"d": digest}, "d", what))


def _differing_key(a: Any, b: Any, prefix: str = "") -> str | None:
    """The first dotted key whose values differ between two configs (None: equal)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            found = _differing_key(a.get(key), b.get(key), f"{prefix}{key}.")
            if found is not None:
                return found
        return None
    return None if a == b else prefix[:-1][:120]


def dispute(
    run_a: str | Path,
    run_b: str | Path,
    referee: str = "native",
    *,
    data: Path | None = None,
    init_from: Path | None = None,
    caps: Mapping[str, float] | None = None,
    progress: Callable[[str], None] | None = None,
) -> Verdict:
    """Settle a dispute between two honest-looking parties for ``run_a`` and ``run_b`` (each re-executes on
    the profile its bundle was recorded on), refereed on ``referee``. Bad input raises :class:`BundleError`."""
    parties = []
    for run in (run_a, run_b):
        b = bundle_mod.Bundle(run)
        b.close()
        # a recorder's own machine (a profile of its own) is not one this machine has: it re-executes here
        own = b.manifest.hardware if b.manifest.hardware in profile_names() else "native"
        parties.append(Party(run, own, data=data, init_from=init_from, caps=caps))
    return Referee(
        Channel("A", parties[0]), Channel("B", parties[1]), run_a, run_b, referee,
        data=data, init_from=init_from, caps=caps, progress=progress,
    ).settle()  # fmt: skip
