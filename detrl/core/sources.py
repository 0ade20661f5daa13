"""The switchboard: one named, seeded, host-side random stream per source of randomness.

Every random decision of a run draws from a *named stream*. Each stream's seed is derived from the base
seed and the stream's name (SHA-256), unless set explicitly, so changing one source never shifts another.
A stream may also be *unseeded*: it then takes a fresh seed from the operating system, and that seed is
recorded in the run bundle so the run can still be replayed.

Streams live on the host (a CPU ``torch.Generator`` and a ``numpy.random.Generator`` per stream), so a CPU
and a GPU run draw the same numbers; random ops inside a step are routed here by
:class:`detrl.core.randomness.StreamRandomMode`.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import random
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

#: Streams every run has. ``bitflip`` moves one initial weight to its neighbouring float when enabled;
#: ``hardware`` names the accumulation-order source (see :mod:`detrl.core.hardware`).
STREAMS: tuple[str, ...] = (
    "init",
    "data_order",
    "augment",
    "dropout",
    "explore",
    "replay",
    "env",
    "sticky",
    "noop",
    "bitflip",
    "hardware",
)


def derive_seed(base_seed: int, name: str) -> int:
    """A 63-bit seed for stream ``name``, a pure function of the base seed and the name."""
    digest = hashlib.sha256(f"detrl/stream/{base_seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def state_bytes(state: Mapping[str, Any]) -> bytes:
    """Canonical bytes of a switchboard state dict (what commitments hash)."""
    return json.dumps(state, sort_keys=True, separators=(",", ":")).encode()


def _seed(value: Any, what: str) -> int:
    """A seed as an int in [0, 2**64): the range torch's and numpy's generators take."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"sources.{what} must be an integer seed, not {value!r}")
    if not 0 <= int(value) < 1 << 64:
        raise ValueError(f"sources.{what} must be in [0, 2**64), not {value}")
    return int(value)


class Sources:
    """The switchboard of a run.

    Args:
        seed: base seed; every stream's seed derives from it unless set in ``streams``.
        streams: per-stream settings, ``{name: {"seed": int | None}}``. ``seed: None`` makes the stream
            unseeded (a fresh OS-drawn seed, recorded so the run stays replayable).
        bitflip: when True, :meth:`apply_bitflip` moves one initial weight (chosen by the ``bitflip``
            stream) to its neighbouring float, as in Summers & Dinneen (2021).
    """

    def __init__(
        self,
        seed: int = 0,
        streams: Mapping[str, Mapping[str, Any]] | None = None,
        bitflip: bool = False,
    ) -> None:
        self.base_seed = _seed(seed, "seed")
        self.bitflip = bool(bitflip)
        self._seeds: dict[str, int] = {}
        self._unseeded: set[str] = set()
        streams = dict(streams or {})
        for name in streams:
            if name not in STREAMS:
                raise ValueError(f"unknown random stream {name!r}; known: {', '.join(STREAMS)}")
        for name in STREAMS:
            spec = dict(streams.get(name) or {})
            if "seed" in spec and spec["seed"] is None:
                self._seeds[name] = int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1)
                self._unseeded.add(name)
            elif spec.get("seed") is not None:
                self._seeds[name] = _seed(spec["seed"], f"{name}.seed")
            else:
                self._seeds[name] = derive_seed(self.base_seed, name)
        self._torch: dict[str, torch.Generator] = {}
        self._numpy: dict[str, np.random.Generator] = {}
        #: each torch stream's last state and its base64: a stream no step drew from (the init stream after
        #: init, the data order within an epoch) is not encoded again at every commitment
        self._encoded: dict[str, tuple[bytes, str]] = {}
        #: :meth:`digest_bytes`' JSON around the torch streams' states, and what it was written from
        self._frame: tuple[Any, list[str], list[bytes]] | None = None

    # ------------------------------------------------------------------ streams
    def seed_of(self, name: str) -> int:
        """The seed of stream ``name`` (explicit, derived, or drawn from the OS when unseeded)."""
        self._check(name)
        return self._seeds[name]

    def torch(self, name: str) -> torch.Generator:
        """The CPU ``torch.Generator`` of stream ``name`` (created on first use)."""
        self._check(name)
        if name not in self._torch:
            self._torch[name] = torch.Generator(device="cpu").manual_seed(self._seeds[name])
        return self._torch[name]

    def numpy(self, name: str) -> np.random.Generator:
        """The ``numpy.random.Generator`` (PCG64) of stream ``name``; independent of :meth:`torch`."""
        self._check(name)
        if name not in self._numpy:
            self._numpy[name] = np.random.Generator(np.random.PCG64(self._seeds[name]))
        return self._numpy[name]

    @contextlib.contextmanager
    def global_torch_rng(self, name: str) -> Iterator[None]:
        """Seed torch's global CPU RNG from stream ``name`` for the block, restoring it afterwards.

        Library code that draws from the global RNG (``nn.Linear``'s default init, say) then draws from
        the stream's seed and nothing else.
        """
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed_of(name))
            yield

    def seed_host_rngs(self, step: int) -> None:
        """Seed Python's ``random`` and NumPy's global RNG for step ``step``, from the ``dropout`` stream's
        seed and the step alone (no stream's state moves).

        Model code that draws from them inside a step then draws the same numbers in the recording and in
        every replay, a segment replayed from a checkpoint included (wav2vec2's SpecAugment masks and layer
        drop take ``np.random``; older layer-drop code takes ``random``). A seed per step, not a stream:
        a stream's state would have to be in every checkpoint, and torch's own random ops, which have one,
        are routed to the dropout stream instead. Randomness inside the model is what the ``dropout`` source
        stands for, so switching that source unseeded changes these draws too.
        """
        seed = derive_seed(self._seeds["dropout"], f"host/{step}")
        random.seed(seed)
        np.random.seed(seed & 0xFFFF_FFFF)  # the legacy global RNG takes 32-bit seeds

    def permutation(self, name: str, n: int) -> torch.Tensor:
        """A random permutation of ``range(n)`` (int64, CPU) drawn from stream ``name``."""
        return torch.randperm(n, generator=self.torch(name))

    def apply_bitflip(self, module: torch.nn.Module) -> str | None:
        """Move one weight of the first layer to its next float (``nextafter``), if bitflip is on.

        The first layer's weight is the first floating (or complex) parameter with two or more dimensions in registration
        order (Summers & Dinneen 2021 flip a first-layer weight; a bias or a batch-norm scale would also do,
        but a weight is what the protocol names). The element is drawn from the ``bitflip`` stream. Returns
        ``"name[index]"`` of the changed element, or None when the switch is off.
        """
        if not self.bitflip:
            return None
        floating = [(n, p) for n, p in module.named_parameters() if p.is_floating_point() or p.is_complex()]
        weights = [(n, p) for n, p in floating if p.dim() >= 2] or floating
        if not weights:
            return None
        name, p = weights[0]
        i = int(torch.randint(p.numel(), (1,), generator=self.torch("bitflip")))
        with torch.no_grad():  # of a complex weight, element i's real part (a view of every other real)
            flat = torch.view_as_real(p).view(-1)[::2] if p.is_complex() else p.view(-1)
            flat[i] = torch.nextafter(flat[i], torch.tensor(float("inf"), dtype=flat.dtype))
        return f"{name}[{i}]"

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: config, seeds and the position of every stream created so far."""
        return {
            "seed": self.base_seed,
            "bitflip": self.bitflip,
            "seeds": dict(self._seeds),
            "unseeded": sorted(self._unseeded),
            "torch": {n: self._torch_state(n, g) for n, g in self._torch.items()},
            "numpy": {n: g.bit_generator.state for n, g in self._numpy.items()},
        }

    def _torch_state(self, name: str, g: torch.Generator) -> str:
        """Stream ``name``'s state as base64 (the bytes of ``g.get_state()``), reused while they are equal."""
        raw = g.get_state().numpy().tobytes()
        last = self._encoded.get(name)
        if last is not None and last[0] == raw:
            return last[1]
        b64 = base64.b64encode(raw).decode()
        self._encoded[name] = (raw, b64)
        return b64

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore seeds and stream positions saved by :meth:`state_dict` (validated: untrusted input)."""
        try:
            seeds = {str(k): int(v) for k, v in dict(state["seeds"]).items()}
            for name in seeds:
                self._check(name)
            self.base_seed = int(state["seed"])
            self.bitflip = bool(state.get("bitflip", False))
            self._seeds.update(seeds)
            self._unseeded = {str(n) for n in state.get("unseeded", [])}
            self._torch.clear()
            self._numpy.clear()
            for name, b64 in dict(state.get("torch", {})).items():
                raw = np.frombuffer(base64.b64decode(b64, validate=True), dtype=np.uint8).copy()
                self.torch(name).set_state(torch.from_numpy(raw))
            for name, st in dict(state.get("numpy", {})).items():
                self.numpy(name).bit_generator.state = dict(st)
        except KeyError as e:
            raise ValueError(f"invalid switchboard state (sources): missing {e}") from None
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"invalid switchboard state (sources): {e}") from None

    def config(self) -> dict[str, Any]:
        """The switchboard as config: base seed and every stream's effective seed (for the manifest)."""
        return {
            "seed": self.base_seed,
            "bitflip": self.bitflip,
            "streams": {n: {"seed": s} for n, s in self._seeds.items()},
        }

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any] | None) -> Sources:
        """Build from a config mapping ``{seed, bitflip, streams: {name: {seed}}}`` or ``{seed, name: {seed}}``."""
        cfg = dict(cfg or {})
        streams = dict(cfg.pop("streams", None) or {})
        seed = cfg.pop("seed", 0)
        bitflip = cfg.pop("bitflip", False)
        for name, spec in cfg.items():
            if name not in STREAMS:
                raise ValueError(f"unknown key sources.{name}; streams are: {', '.join(STREAMS)}")
            streams[name] = spec
        return cls(seed=seed, streams=streams, bitflip=bitflip)

    def digest_bytes(self) -> bytes:
        """Canonical bytes of the switchboard state, for commitments: :func:`state_bytes` of
        :meth:`state_dict`, every step. The torch generators' states are most of them (5 KB of base64 each)
        and, with the numpy generators', all that moves from step to step. The JSON around the torch states
        is kept, cut where each goes, and written again only when the rest of the state differs from the
        last call's: inside a training loop, writing it afresh (JSON scans a string for characters to escape,
        which base64 has none of) cost about 0.1 ms of a 10 ms step."""
        numpy_states = {n: g.bit_generator.state for n, g in self._numpy.items()}
        # What the frame is written from. Compared with ==: every value is an int, a bool, a str or a dict
        # of those, and no int field ever holds a bool (_seed refuses one), so equal means equal JSON.
        rest = (self.base_seed, self.bitflip, dict(self._seeds), sorted(self._unseeded), list(self._torch),
                numpy_states)  # fmt: skip
        if self._frame is None or self._frame[0] != rest:
            self._frame = (rest, *self._cut_frame(numpy_states))
        _, order, pieces = self._frame
        out = [pieces[0]]
        for name, piece in zip(order, pieces[1:]):
            out.append(self._torch_state(name, self._torch[name]).encode())
            out.append(piece)
        return b"".join(out)

    def _cut_frame(self, numpy_states: dict[str, Any]) -> tuple[list[str], list[bytes]]:
        """The canonical JSON of the state with each torch stream's state left out: the streams in the order
        their states appear in it, and the pieces around them (one more than the streams)."""
        state = self.state_dict()
        state["numpy"] = numpy_states
        state["torch"] = {name: f"@detrl-stream-{name}@" for name in self._torch}
        text = state_bytes(state)
        at = sorted((text.index(f'"@detrl-stream-{name}@"'.encode()), name) for name in self._torch)
        pieces, start = [], 0
        for position, name in at:
            pieces.append(text[start : position + 1])  # through the opening quote
            start = position + len(f'"@detrl-stream-{name}@"') - 1  # from the closing quote
        pieces.append(text[start:])
        return [name for _, name in at], pieces

    def _check(self, name: str) -> None:
        if name not in STREAMS:
            raise KeyError(f"unknown random stream {name!r}; known: {', '.join(STREAMS)}")
