"""Commitments: canonical BLAKE3 of training state, and a Merkle tree over the per-step hashes.

The canonical bytes of a state are name-sorted tensor records ``name, dtype, shape, byte count, BLAKE3 of
the raw little-endian bytes``, so two machines that hold the same tensors produce the same hash whatever
their memory layout or device. A record holds its bytes' digest, not the bytes: each tensor's bytes are
then hashed from their first byte, where BLAKE3 hashes chunks side by side (an 80-byte header in front
made a small tensor's hash 2.7x slower), and a state hash is one BLAKE3 call per tensor.

Every hash input but a tensor's raw bytes starts with one of the tags below. They are distinct and none is
a prefix of another, so a tensor record, a state, a batch, a Merkle leaf and a Merkle node can never be the
same byte string: a collision between two kinds is a BLAKE3 collision. The raw bytes' digest needs no tag:
it appears only inside a tensor record, at the place the record's parse fixes. The security argument is
in docs/verifiable.md.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import struct
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import blake3
import numpy as np
import torch

#: The hash function of every commitment (256-bit output); the bundle manifest's version names it.
HASH_NAME = "blake3"
DIGEST_BYTES = 32
TENSOR_TAG = b"detrl/tensor/v3\0"
STATE_TAG = b"detrl/state/v3\0"
BATCH_TAG = b"detrl/batch/v3\0"
LEAF_TAG = b"detrl/leaf/v2\0"
NODE_TAG = b"detrl/node/v2\0"

# Raw bytes are hashed as the machine holds them; the canonical bytes are little-endian.
assert sys.byteorder == "little", "detrl's commitments assume a little-endian machine"


def _hasher(data: bytes = b"") -> Any:
    """A fresh BLAKE3 state. Single-threaded: ``max_threads`` was no faster on 188 MB on the 2-core
    development machine (2.7 vs 2.8 GB/s), and a step's own threads are idle only after it."""
    return blake3.blake3(data)


class _Memory:
    """A contiguous CPU tensor's memory as numpy reads it (``__array_interface__``, read-only bytes), holding
    the tensor. ``Tensor.numpy()`` would mark the tensor's storage as never resizable again, for good: a
    model that resizes a buffer in place (``torch.ao.quantization``'s observers size their empty ``min_val``
    at the first batch) failed after its first commitment with "Trying to resize storage that is not
    resizable". A resize that moves the memory changes ``data_ptr``, which the digest cache checks before it
    reads a view it kept (:meth:`DigestCache.record`, ``SteadyRecords``)."""

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t
        nbytes = t.numel() * t.element_size()
        self.__array_interface__ = {
            "data": (t.data_ptr(), True),
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
        }


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's raw little-endian bytes as a read-only 1-d uint8 array: a view when already on the CPU
    and contiguous (hashing a copy of a ResNet-50's state cost as much as the hash), which leaves the
    tensor's storage as it was (resizable: :class:`_Memory`)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.is_conj() or t.is_neg():  # lazy bits: the memory holds the values before them
        t = t.resolve_conj().resolve_neg()
    return np.asarray(_Memory(t))


#: The NaN every NaN is committed as, where a commitment takes NaNs as one (rules revision 13: IEEE leaves a
#: NaN's sign and payload to the hardware and the order of operands), by dtype: the view under which a NaN
#: test is one vectorised ``max`` (None: the word test below only), the unsigned word of an element (a
#: complex number's part), the mask of the bits but the sign, the largest such bits that are not a NaN, and
#: the NaN taken: positive and quiet, as torch writes ``float("nan")`` in the dtype (payload zero, but FP8
#: E5M2's all ones). The FP8 formats without a negative zero have one NaN already.
_FP64_NAN = (np.float64, np.uint64, 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000, 0x7FF8_0000_0000_0000)
_FP32_NAN = (np.float32, np.uint32, 0x7FFF_FFFF, 0x7F80_0000, 0x7FC0_0000)
_NANS: dict[torch.dtype, tuple[Any, Any, int, int, int]] = {
    torch.float64: _FP64_NAN,
    torch.complex128: _FP64_NAN,
    torch.float32: _FP32_NAN,
    torch.complex64: _FP32_NAN,
    torch.float16: (np.float16, np.uint16, 0x7FFF, 0x7C00, 0x7E00),
    torch.bfloat16: (None, np.uint16, 0x7FFF, 0x7F80, 0x7FC0),
    torch.float8_e5m2: (None, np.uint8, 0x7F, 0x7C, 0x7F),
    torch.float8_e4m3fn: (None, np.uint8, 0x7F, 0x7E, 0x7F),  # S.1111.111 is its NaN, either sign
}


def nans_canonical(data: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """``data`` (a ``dtype`` tensor's raw bytes, 1-d uint8) with every NaN's bits replaced by the one NaN of
    ``dtype`` (:data:`_NANS`): ``data`` itself where it holds no NaN, else a copy.

    The test costs a tenth of the BLAKE3 of the same bytes (one ``max``, which only a NaN makes a NaN)."""
    spec = _NANS.get(dtype)
    if spec is None or data.nbytes == 0:
        return data
    as_float, word, magnitude, largest, nan = spec
    if as_float is not None and not np.isnan(data.view(as_float).max()):
        return data
    words = data.view(word)
    found = (words & word(magnitude)) > word(largest)
    if not found.any():
        return data
    out = words.copy()
    out[found] = nan
    return out.view(np.uint8)


@functools.lru_cache(maxsize=4096)
def _record_header(name: str, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int) -> bytes:
    """``TENSOR_TAG, len(name), name, len(dtype), dtype, ndim, dims..., nbytes`` (little-endian u32/u64).

    Every field is length-prefixed or fixed-width, so a record (this header, then the 32-byte digest of the
    raw bytes) parses back uniquely: two records with a different name, dtype or shape differ as byte
    strings, whatever the digest that follows."""
    n = name.encode()
    d = str(dtype).removeprefix("torch.").encode()
    dims = struct.pack(f"<I{len(shape)}Q", len(shape), *shape)
    return (
        TENSOR_TAG
        + struct.pack("<I", len(n))
        + n
        + struct.pack("<I", len(d))
        + d
        + dims
        + struct.pack("<Q", nbytes)
    )


def _record(header: bytes, data: np.ndarray) -> bytes:
    """A tensor's record: its header (:func:`_record_header`), then the BLAKE3 (32 bytes) of its raw bytes."""
    return header + _hasher(data).digest()


def tensor_record(name: str, t: torch.Tensor, canonical_nans: bool = False) -> bytes:
    """One named tensor's canonical record: its header (:func:`_record_header`: name, dtype, shape, byte
    count), then the BLAKE3 (32 bytes) of its raw bytes (with ``canonical_nans``: with every NaN as the
    one NaN of its dtype, :func:`nans_canonical`)."""
    data = tensor_bytes(t)
    header = _record_header(name, t.dtype, tuple(t.shape), data.nbytes)
    return _record(header, nans_canonical(data, t.dtype) if canonical_nans else data)


def tensor_digest(name: str, t: torch.Tensor, canonical_nans: bool = False) -> bytes:
    """BLAKE3 (32 bytes) of one named tensor's canonical record (:func:`tensor_record`).

    Raw bytes for every dtype, FP64 included: hashing the FP32 bytes of FP32-grid FP64 tensors halves the
    bytes but needs a cast and an exactness check, which cost more than BLAKE3 saves (docs/verifiable.md)."""
    return _hasher(tensor_record(name, t, canonical_nans)).digest()


#: Copies up to this size are kept as ``bytes`` and compared with one ``tobytes() ==`` (a memcmp): numpy's
#: ``array_equal`` costs ~10 us a call, which on a DQN's 30 small tensors was more than hashing them.
_SMALL_COPY = 64 << 10


@dataclasses.dataclass
class _Entry:
    record: bytes  # the tensor's record: header, then its bytes' digest
    dtype: torch.dtype
    shape: torch.Size
    #: The tensor and a uint8 view of its memory, while it is a contiguous CPU tensor: building the view
    #: (detach, numpy, reshape, view) cost ~4 us a tensor. ``layout`` is what the view depends on.
    src: torch.Tensor | None = None
    view: np.ndarray | None = None
    layout: tuple[Any, ...] = ()
    header: bytes = b""  # the tensor's record header, while ``view`` is kept
    copy: bytes | np.ndarray | None = None  # the bytes ``record`` was computed from, when kept
    changed_run: int = 0  # consecutive commitments at which the tensor changed
    retry_in: int = 0  # commitments until a copy is kept again (after it was dropped)
    backoff: int = 0  # the next wait after a drop (doubles each time)


@dataclasses.dataclass
class _SteadyPlan:
    """The steady tensors of a state, rehashed in one call (:meth:`DigestCache.records`)."""

    records: Any  # the native SteadyRecords, over the steady names
    names: list[str]  # every name of the state, sorted
    steady_at: list[int]  # the positions in ``names`` of the steady ones
    entries: list[_Entry]  # theirs, in that order
    members: frozenset[str]  # their names
    others: list[tuple[int, str]]  # the rest: (position, name), each taken by record()
    lasts: int  # the calls it serves: the least retry_in among its entries
    last: list[bytes]  # the steady records of its last call
    calls: int = 0


class DigestCache:
    """Per-tensor records of the last commitment, reused for a tensor whose bytes did not change.

    "Did not change" is tested on the bytes themselves: the cache keeps a copy of the bytes each record's
    digest was computed from and compares them (a memcmp for small tensors, ``np.array_equal`` on 8-byte
    words for large ones, several GB/s) before rehashing. torch's version counters are not used: they miss
    fused and foreach writes. A tensor whose dtype, shape and bytes equal the copy has the same canonical
    record, so the reused record is the record a fresh hash would give: the commitments never depend on
    the cache.

    Memory: copies take at most ``budget_bytes`` (64 MiB by default; a ResNet-50's FP64 state with SGD
    momentum is 377 MB, and the peak-memory goal of verifiable precision is 1.2x plain FP64). A tensor that
    changed at each of its last ``drop_after`` commitments (weights under SGD) loses its copy: comparing
    it is wasted work and copying it costs a third of a hash. It gets a copy again after
    ``8, 16, ..., 1024`` commitments, so a model whose layers stop changing (frozen in fine-tuning) is
    found again. The cache holds a reference to each tensor it has a view of (until the name's next
    commitment sees another tensor).

    ``steady``: where given (the native extension's ``SteadyRecords``, passed in by the engine), the tensors
    of a state in the steady state of one written at each commitment (no copy, a kept view) are checked and
    rehashed in one call (:meth:`records`), the others one by one, until one of them is due for a copy
    again or another joins them: in a training loop the per-tensor Python of :meth:`record` cost as much as
    the hashing. The records are the same bytes either way.
    """

    def __init__(
        self,
        budget_bytes: int = 64 << 20,
        drop_after: int = 2,
        steady: Callable[..., Any] | None = None,
        canonical_nans: bool = False,
    ) -> None:
        self.budget_bytes = int(budget_bytes)
        #: the records take every NaN as its dtype's one NaN (:func:`tensor_record`); copies keep raw bytes
        self.canonical_nans = bool(canonical_nans)
        self.drop_after = int(drop_after)
        self.copy_bytes = 0
        self.hits = self.misses = 0  # records reused / hashed (for tests and benchmarks)
        self._entries: dict[str, _Entry] = {}
        self._steady = steady
        self._plan: _SteadyPlan | None = None

    def records(self, tensors: Mapping[str, torch.Tensor]) -> list[bytes]:
        """The record of each tensor (:meth:`record`), in name order."""
        plan = self._plan
        if plan is not None:
            got = plan.records.records(tensors) if type(tensors) is dict else None  # it reads a dict's items
            if got is not None and all(name in tensors for _, name in plan.others):
                plan.last, plan.calls = got, plan.calls + 1
                self.misses += len(got)
                joined = False  # whether one of the others is steady now
                if plan.others:
                    out = [b""] * len(plan.names)
                    for i, record in zip(plan.steady_at, got):
                        out[i] = record
                    for i, name in plan.others:
                        out[i] = self.record(name, tensors[name])
                        joined = joined or _steady(self._entries[name], tensors[name])
                else:
                    out = got
                if joined or plan.calls == plan.lasts:  # the first due for a copy leaves: record() takes it
                    self._settle()
                    self._plan_for(plan.names, tensors, out)
                return out
            self._settle()  # another state (a tensor swapped, resized, added or gone): record() sees it
        names = sorted(tensors)
        out = [self.record(name, tensors[name]) for name in names]
        if self._steady is not None:
            self._plan_for(names, tensors, out)
        return out

    def _plan_for(self, names: list[str], tensors: Mapping[str, torch.Tensor], out: list[bytes]) -> None:
        """Start a plan for the tensors of ``names`` that would take :meth:`record`'s steady path next time
        (at least two: one is no call saved)."""
        steady_at = [i for i, name in enumerate(names) if _steady(self._entries[name], tensors[name])]
        if len(steady_at) < 2:
            return
        steady = [names[i] for i in steady_at]
        entries = [self._entries[name] for name in steady]
        sources = [e.src for e in entries]
        headers, views = [e.header for e in entries], [e.view for e in entries]
        canonical = _nans_canonical_of if self.canonical_nans else None
        records = self._steady(steady, sources, headers, views, _hasher, len(names), canonical)
        members = frozenset(steady)
        others = [(i, name) for i, name in enumerate(names) if name not in members]
        last = [out[i] for i in steady_at]
        lasts = min(e.retry_in for e in entries)
        self._plan = _SteadyPlan(records, names, steady_at, entries, members, others, lasts, last)

    def _settle(self) -> None:
        """End the plan: each entry as the plan's calls of :meth:`record`'s steady path would have left it."""
        plan, self._plan = self._plan, None
        assert plan is not None
        for e, record in zip(plan.entries, plan.last):
            e.retry_in -= plan.calls
            e.changed_run += plan.calls
            e.record = record

    def _hashed(self, data: np.ndarray, t: torch.Tensor) -> np.ndarray:
        """The bytes of ``t`` (``data``) its record hashes."""
        return nans_canonical(data, t.dtype) if self.canonical_nans else data

    def record(self, name: str, t: torch.Tensor) -> bytes:
        """``t``'s record under ``name`` (:func:`tensor_record`), reused if its bytes did not change."""
        if self._plan is not None and name in self._plan.members:  # its counters are the plan's till then
            self._settle()
        e = self._entries.get(name)
        layout = (t.data_ptr(), t.dtype, t.shape, t.stride())  # what the kept view depends on
        if e is not None and e.src is t and e.layout == layout:
            data = e.view
            assert data is not None
            if e.copy is None and e.retry_in > 0:
                # The steady state of a tensor written at every step (weights under SGD or Adam): no copy
                # to compare, the same view and header. Rehash it; the rest is what the path below does.
                e.retry_in -= 1
                e.changed_run += 1
                self.misses += 1
                e.record = _record(e.header, self._hashed(data, t))
                return e.record
        else:
            data = tensor_bytes(t)
        if (
            e is not None
            and e.copy is not None
            and e.dtype == t.dtype
            and e.shape == t.shape
            and _same_bytes(e.copy, data)
        ):
            e.changed_run = 0
            self.hits += 1
            return e.record
        self.misses += 1
        header = _record_header(name, t.dtype, tuple(t.shape), data.nbytes)
        record = _record(header, self._hashed(data, t))
        if e is None:
            e = self._entries[name] = _Entry(record, t.dtype, t.shape)
        else:
            e.record, e.dtype, e.shape = record, t.dtype, t.shape
            e.changed_run += 1
        if e.src is not t or e.layout != layout:
            aliased = t.device.type == "cpu" and t.is_contiguous()  # else ``data`` is a copy, not a view
            e.src, e.view, e.layout = (t, data, layout) if aliased else (None, None, ())
            e.header = header if aliased else b""
        self._keep(e, data)
        return record

    def _keep(self, e: _Entry, data: np.ndarray) -> None:
        """Update, drop or (re)take ``e``'s copy of ``data`` under the budget and the drop rule."""
        if e.copy is not None:
            if e.changed_run >= self.drop_after or len(e.copy) != data.nbytes:
                self._drop(e)
            elif isinstance(e.copy, bytes):
                e.copy = data.tobytes()
            else:
                np.copyto(e.copy, data)
            return
        if e.retry_in > 0:
            e.retry_in -= 1
            return
        if self.copy_bytes + data.nbytes <= self.budget_bytes:
            e.copy = data.tobytes() if data.nbytes <= _SMALL_COPY else data.copy()
            e.changed_run = 0
            self.copy_bytes += data.nbytes

    def _drop(self, e: _Entry) -> None:
        assert e.copy is not None
        self.copy_bytes -= len(e.copy)
        e.copy = None
        e.backoff = min(max(8, 2 * e.backoff), 1024)
        e.retry_in = e.backoff


def _nans_canonical_of(view: np.ndarray, t: torch.Tensor) -> np.ndarray:
    """:func:`nans_canonical` of ``t``'s bytes (``view``): what ``SteadyRecords`` hashes where it found a NaN."""
    return nans_canonical(view, t.dtype)


def _steady(e: _Entry, t: torch.Tensor) -> bool:
    """Whether :meth:`DigestCache.record` would take its steady path for ``t`` next: no copy to compare, a
    wait before the next copy, and a view of ``t``'s memory kept."""
    return e.copy is None and e.retry_in > 0 and e.src is t and e.view is not None


def _same_bytes(copy: bytes | np.ndarray, data: np.ndarray) -> bool:
    """Whether ``data`` (1-d uint8) holds the bytes of ``copy``. Large ones are compared as 8-byte words
    when they divide evenly (numpy's compare costs per element; its bool temporary is 8x smaller)."""
    if len(copy) != data.nbytes:
        return False
    if isinstance(copy, bytes):
        return data.tobytes() == copy
    if data.nbytes % 8 == 0 and data.ctypes.data % 8 == 0 and copy.ctypes.data % 8 == 0:
        return bool(np.array_equal(data.view(np.uint64), copy.view(np.uint64)))
    return bool(np.array_equal(data, copy))


def hash_tensors(
    tensors: Mapping[str, torch.Tensor],
    extra: Iterable[tuple[str, bytes]] = (),
    cache: DigestCache | None = None,
    tag: bytes = STATE_TAG,
    canonical_nans: bool = False,
) -> bytes:
    """BLAKE3 of ``tag, count, name-sorted tensor records, count, name-sorted extra blobs``.

    Each tensor record (:func:`tensor_record`) carries its own name, dtype, shape and byte count, and the
    digest of its bytes; the counts and the length prefixes of the extra names and blobs make the encoding
    parse back uniquely. ``cache``: take unchanged tensors' records from it (:class:`DigestCache`: its own
    byte comparison decides, never a claim of the caller's; it takes NaNs as ``canonical_nans`` says).
    ``canonical_nans``: each record takes every NaN as its dtype's one NaN (:func:`nans_canonical`).
    """
    h = _hasher(tag + struct.pack("<Q", len(tensors)))
    if cache is not None:
        if cache.canonical_nans != canonical_nans:
            raise ValueError("hash_tensors: the digest cache takes NaNs otherwise than asked")
        records = cache.records(tensors)
    else:
        records = [tensor_record(name, tensors[name], canonical_nans) for name in sorted(tensors)]
    h.update(b"".join(records))  # one call, not one each
    blobs = sorted(extra)
    h.update(struct.pack("<Q", len(blobs)))
    for name, blob in blobs:
        n = name.encode()
        h.update(struct.pack("<I", len(n)) + n + struct.pack("<Q", len(blob)))
        h.update(blob)
    return h.digest()


def state_hash(
    tensors: Mapping[str, torch.Tensor],
    sources: bytes,
    parts: Mapping[str, bytes],
    cache: DigestCache | None = None,
    canonical_nans: bool = False,
) -> bytes:
    """A step's state commitment: the state tensors, the switchboard's canonical bytes (``sources``) and
    each attached part's digest (``parts``: name -> digest, e.g. a replay buffer's hash chain).
    ``canonical_nans``: from rules revision 13 (:func:`detrl.core.oprules.canonical_nans`), every NaN is
    committed as its dtype's one NaN (:func:`nans_canonical`)."""
    extra = [("sources", sources), *((f"part/{name}", digest) for name, digest in parts.items())]
    return hash_tensors(tensors, extra, cache, canonical_nans=canonical_nans)


def optimizer_tensors(opt: torch.optim.Optimizer, param_names: Mapping[int, str]) -> dict[str, torch.Tensor]:
    """The optimizer's state tensors keyed ``opt.<param name>.<state key>`` (scalars as 0-d tensors)."""
    out: dict[str, torch.Tensor] = {}
    for p, state in opt.state.items():
        pname = param_names.get(id(p), "?")
        for key, value in state.items():
            if not isinstance(value, (torch.Tensor, int, float)):  # a bool is an int
                raise ValueError(
                    f"{type(opt).__name__}: state {key!r} of {pname} is a {type(value).__name__}; a run commits "
                    "an optimizer's state as tensors and numbers"
                )
            out[f"opt.{pname}.{key}"] = (
                value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
            )
    return out


def state_tensors(
    model: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()
) -> dict[str, torch.Tensor]:
    """Everything tensor-valued that determines the future: parameters, buffers, optimizer state."""
    out: dict[str, torch.Tensor] = {}
    names: dict[int, str] = {}
    for name, p in model.named_parameters():
        out[f"param.{name}"] = p
        names[id(p)] = name
    for name, b in model.named_buffers():
        out[f"buffer.{name}"] = b
    for i, opt in enumerate(optimizers):
        for k, v in optimizer_tensors(opt, names).items():
            out[f"{i}.{k}"] = v
    return out


#: The ``torch.nn.Module`` methods :func:`state_tensors`' answer comes from: a module class that overrides one
#: of them may answer differently with the same dictionaries, so :class:`StateTensorCache` does not cache it.
_LISTING_METHODS = ("named_parameters", "named_buffers", "named_modules", "_named_members", "named_children")


class StateTensorCache:
    """:func:`state_tensors` for one training loop, rebuilt only when what it is read from may have changed.

    In a small model's loop, walking the modules and the optimizers' state at every commitment cost about
    0.15-0.19 ms of a 10 ms step (the tiny transformer's 72 tensors). The answer depends only on, for every
    module in the tree, its class and its ``_modules``, ``_parameters`` and ``_buffers`` dictionaries, and
    on each optimizer's ``state`` and the per-parameter dictionaries in it. This keeps the size of each, and
    its keys and the very objects it held, and checks them by identity at each call, reading the model's and
    the optimizers' dictionaries afresh: a submodule, parameter, buffer or state entry added, removed or
    replaced anywhere, or a dictionary replaced by one holding other objects, shows. Identity, never ``==``:
    a tensor's is elementwise, and equal values in a new tensor are a new state entry. It does not cache
    where a module class overrides one of the listing methods (:data:`_LISTING_METHODS`), or where an
    optimizer's state holds a number (committed as a new 0-d tensor each time): those are read afresh at
    every call, and, once found so, that model and those optimizers are read afresh for good, without
    walking them a second time to check. It holds references to what it checks, so that no object's id can
    be reused under it. Each call returns a new dict.

    ``same_listing``: where given (the native extension's, passed in by the engine), the check runs in one
    call with the same answer; in a training loop, where it runs cold, the Python check cost about 0.09 ms of
    a small model's step.
    """

    def __init__(self, same_listing: Callable[..., bool] | None = None) -> None:
        self._same_listing = same_listing
        self._model: torch.nn.Module | None = None
        self._optimizers: tuple[torch.optim.Optimizer, ...] = ()
        self._modules: list[torch.nn.Module] = []
        self._classes: list[type] = []
        self._per_parameter: list[dict[str, Any]] = []  # each optimizer's per-parameter state dicts, in order
        self._sizes: list[int] = []
        self._keys: list[Any] = []
        self._values: list[Any] = []
        # None: nothing kept yet, or the model and optimizers kept are read afresh at every call
        self._out: dict[str, torch.Tensor] | None = None
        self.rebuilds = 0  # calls that walked the model (for tests)

    def __call__(
        self, model: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()
    ) -> dict[str, torch.Tensor]:
        optimizers = tuple(optimizers)
        if self._out is not None and self._unchanged(model, optimizers):
            return dict(self._out)
        self.rebuilds += 1
        out = state_tensors(model, optimizers)
        if self._out is None and self._same_loop(model, optimizers):
            return out  # this loop was found uncacheable: no second walk to check it again
        self._out = dict(out) if self._snapshot(model, optimizers) else None
        return out

    def _same_loop(self, model: torch.nn.Module, optimizers: tuple[torch.optim.Optimizer, ...]) -> bool:
        return (
            model is self._model
            and len(optimizers) == len(self._optimizers)
            and all(map(operator.is_, optimizers, self._optimizers))
        )

    def _dicts(self, optimizers: tuple[torch.optim.Optimizer, ...]) -> list[Mapping[Any, Any]]:
        """The dictionaries the listing reads, as they are now (the per-parameter ones: those kept, which
        the optimizers' ``state`` values are checked to be)."""
        modules = itertools.chain.from_iterable(map(_MODULE_DICTS, self._modules))
        return [*modules, *(opt.state for opt in optimizers), *self._per_parameter]

    def _unchanged(self, model: torch.nn.Module, optimizers: tuple[torch.optim.Optimizer, ...]) -> bool:
        if not self._same_loop(model, optimizers):
            return False
        if self._same_listing is not None:
            modules, classes, per_parameter = self._modules, self._classes, self._per_parameter
            return self._same_listing(
                modules, classes, optimizers, per_parameter, self._sizes, self._keys, self._values
            )
        if not all(map(operator.is_, map(type, self._modules), self._classes)):
            return False
        dicts = self._dicts(optimizers)
        if list(map(len, dicts)) != self._sizes:
            return False
        keys = itertools.chain.from_iterable(dicts)
        values = itertools.chain.from_iterable(map(_values, dicts))
        return all(map(operator.is_, keys, self._keys)) and all(map(operator.is_, values, self._values))

    def _snapshot(self, model: torch.nn.Module, optimizers: tuple[torch.optim.Optimizer, ...]) -> bool:
        """Keep what :meth:`_unchanged` checks; False where the answer must be read afresh each time."""
        self._model, self._optimizers = model, optimizers
        # the walk named_parameters and named_buffers make
        self._modules = [m for _, m in model.named_modules()]
        self._classes = [type(m) for m in self._modules]
        for cls in set(self._classes):
            if any(getattr(cls, name) is not getattr(torch.nn.Module, name) for name in _LISTING_METHODS):
                return False
        self._per_parameter = [state for opt in optimizers for state in opt.state.values()]
        for state in self._per_parameter:
            if not all(isinstance(v, torch.Tensor) for v in state.values()):
                return False
        dicts = self._dicts(optimizers)
        self._sizes = list(map(len, dicts))
        self._keys = list(itertools.chain.from_iterable(dicts))
        self._values = list(itertools.chain.from_iterable(map(_values, dicts)))
        return True


#: A module's dictionaries that :func:`state_tensors` reads (:class:`StateTensorCache`).
_MODULE_DICTS = operator.attrgetter("_modules", "_parameters", "_buffers")
_values = operator.methodcaller("values")


def leaf(step: int, state_hash: bytes, batch_hash: bytes) -> bytes:
    """The Merkle leaf of one step: binds the step number, the state after it and the batch it used."""
    return _hasher(LEAF_TAG + struct.pack("<Q", step) + state_hash + batch_hash).digest()


def node(left: bytes, right: bytes) -> bytes:
    """The Merkle node over two child hashes (32 bytes each), left first."""
    return _hasher(NODE_TAG + left + right).digest()


def merkle_levels(leaves: list[bytes]) -> list[list[bytes]]:
    """Every level of the Merkle tree over ``leaves`` (at least one), leaves first, the root alone last: each
    level pairs its nodes left to right with :func:`node`, and an odd last node is carried up unchanged.
    Inclusion proofs (detrl/formats/proof.py) and disputes (detrl/apps/dispute.py) walk these levels;
    :func:`merkle_root` gives the same root without them."""
    levels = [list(leaves)]
    while len(levels[-1]) > 1:
        level = levels[-1]
        up = [node(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            up.append(level[-1])
        levels.append(up)
    return levels


def merkle_root(leaves: Iterable[bytes]) -> bytes:
    """Merkle root (BLAKE3, leaves and nodes domain-separated; the tree of :func:`merkle_levels`), folded
    leaf by leaf (:class:`MerkleFrontier`): a root of millions of leaves holds a hash per power of two, not
    a level of the tree. Empty -> hash of the node tag."""
    frontier = MerkleFrontier()
    frontier.extend(leaves)
    return frontier.root()


class MerkleFrontier:
    """The Merkle root of a list of leaf hashes that only grows, kept as the roots of its complete subtrees.

    The tree of :func:`merkle_levels` over ``n`` leaves, whose odd last node is carried up unchanged, is the
    tree whose left part is the complete tree over the first ``2**k`` leaves (the largest power of two below
    ``n``) and whose right part is the same tree over the rest. So its root folds the roots of the complete
    subtrees of ``n``'s binary digits (the *peaks*, largest first) from the right: ``node(p1, node(p2,
    p3))``. Appending a leaf merges equal peaks as adding 1 to a binary counter carries: a hash per leaf
    and one per carry (one on average). The root costs a hash per peak. A recorder that publishes a root at
    each durable point thus hashes each leaf once in a run, not once per durable point after it (a million
    steps cost 3-4 s a root), and holds at most 64 hashes.
    """

    def __init__(self) -> None:
        self.count = 0  # leaves appended
        self._peaks: list[bytes] = []  # roots of complete subtrees of 2**k leaves, k decreasing

    def append(self, leaf_hash: bytes) -> None:
        self._peaks.append(leaf_hash)
        self.count += 1
        carries = self.count
        while carries % 2 == 0:  # the two smallest peaks hold as many leaves: they join
            right = self._peaks.pop()
            self._peaks[-1] = node(self._peaks[-1], right)
            carries //= 2

    def extend(self, leaf_hashes: Iterable[bytes]) -> None:
        for h in leaf_hashes:
            self.append(h)

    def root(self) -> bytes:
        """The root over the leaves so far (:func:`merkle_root`)."""
        if not self._peaks:
            return _hasher(NODE_TAG).digest()
        acc = self._peaks[-1]
        for peak in reversed(self._peaks[:-1]):
            acc = node(peak, acc)
        return acc


def hash_batch(*tensors: Any) -> bytes:
    """Digest of a training batch, so a changed example shows at its step.

    Each argument is a tensor, an array or a number, or a dict, list or tuple of them, nested as deep as
    wanted (a Hugging Face batch of ``input_ids``, ``attention_mask`` and ``labels``). Every leaf is named
    by its path (``0``, ``1['labels']``, ``2[0]``); a ``None`` or a string leaf is hashed by name and value.
    Whatever ``torch.as_tensor`` takes is one tensor, as it always was.
    """
    items: dict[str, torch.Tensor] = {}
    extra: list[tuple[str, bytes]] = []
    for i, t in enumerate(tensors):
        _batch_leaf(f"{i}", t, items, extra)
    return hash_tensors(items, extra, tag=BATCH_TAG)


def _batch_leaf(name: str, t: Any, items: dict[str, torch.Tensor], extra: list[tuple[str, bytes]]) -> None:
    """Put ``t`` (at path ``name``) into ``items`` or ``extra`` for :func:`hash_batch`. ``torch.as_tensor`` is
    tried first: a DQN hashes a transition of arrays and numbers at every env step."""
    if isinstance(t, torch.Tensor):
        items[name] = t
        return
    try:
        items[name] = torch.as_tensor(t)  # an array, a number, a list of numbers: as always
        return
    except (TypeError, ValueError, RuntimeError):
        pass
    if isinstance(t, Mapping):
        for key, value in t.items():
            _batch_leaf(f"{name}[{key!r}]", value, items, extra)
    elif t is None or isinstance(t, str):
        extra.append((name, b"\0" if t is None else b"\1" + t.encode()))
    elif isinstance(t, (list, tuple)):  # of tensors of several elements, of dicts, ...
        for i, value in enumerate(t):
            _batch_leaf(f"{name}[{i}]", value, items, extra)
    else:
        raise TypeError(
            f"cannot hash the batch's {type(t).__name__} at {name}: a batch holds tensors, arrays, numbers, "
            "strings or None, or dicts, lists and tuples of them"
        )
