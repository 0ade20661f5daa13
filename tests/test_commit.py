"""Commitments (detrl/formats/commit.py): the canonical encoding is injective, and the digest cache's test of
"unchanged" is sound (it compares bytes, so fused and foreach writes are caught)."""

from __future__ import annotations

import functools
import itertools
import math
import types
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detrl.core import extensions
from detrl.formats import commit


def _digests(cases: dict[str, tuple[str, torch.Tensor]]) -> dict[str, bytes]:
    return {k: commit.tensor_digest(name, t) for k, (name, t) in cases.items()}


def test_tensor_records_differ_across_name_dtype_shape_and_bytes() -> None:
    """Same bytes under another dtype, shape or name are other records; so are FP64 values that round to
    the same FP32 value (an encoding that hashed the FP32 cast of FP64 state would collide there)."""
    x = torch.arange(6, dtype=torch.float32)
    on_grid = torch.tensor([1.0, 0.1], dtype=torch.float32).double()
    off_grid = on_grid.clone()
    off_grid[1] = torch.nextafter(off_grid[1], torch.tensor(1.0, dtype=torch.float64))
    assert off_grid[1] != on_grid[1] and off_grid.float().equal(on_grid.float())
    cases = {
        "f32 (6,)": ("w", x),
        "f32 (2,3)": ("w", x.reshape(2, 3)),
        "f32 (3,2)": ("w", x.reshape(3, 2)),
        "f32 (6,1)": ("w", x.reshape(6, 1)),
        "i32 same bytes": ("w", x.view(torch.int32)),
        "u8 same bytes": ("w", x.view(torch.uint8)),
        "other name": ("v", x),
        "name absorbing dtype": ("wfloat32", x),
        "empty f32": ("w", torch.zeros(0)),
        "empty f32 (0,3)": ("w", torch.zeros(0, 3)),
        "empty f64": ("w", torch.zeros(0, dtype=torch.float64)),
        "scalar": ("w", torch.tensor(0.0)),
        "one-element": ("w", torch.zeros(1)),
        "fp64 on grid": ("w", on_grid),
        "fp64 off grid": ("w", off_grid),
        "fp32 of on grid": ("w", on_grid.float()),
        "+0": ("w", torch.tensor([0.0], dtype=torch.float64)),
        "-0": ("w", torch.tensor([-0.0], dtype=torch.float64)),
        "bf16": ("w", torch.ones(2, dtype=torch.bfloat16)),
        "f16": ("w", torch.ones(2, dtype=torch.float16)),
    }
    d = _digests(cases)
    for (a, da), (b, db) in itertools.combinations(d.items(), 2):
        assert da != db, f"{a!r} and {b!r} have the same record digest"


def test_record_is_independent_of_layout() -> None:
    """A transposed-then-contiguous copy and a strided view of the same values hash alike."""
    x = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    t = x.t()
    assert not t.is_contiguous()
    assert commit.tensor_digest("w", t) == commit.tensor_digest("w", t.contiguous())


def test_a_state_hash_is_the_documented_encoding_written_out() -> None:
    """docs/verifiable.md's encoding, written out here without commit.py's helpers: the state tag, the
    tensor count, each tensor's record (tag, name, dtype, shape, byte count, BLAKE3 of its raw bytes) in
    name order, then the blobs. A change of the encoding must change this test and the bundle version."""
    import struct

    import blake3

    tensors = {
        "b": torch.arange(6, dtype=torch.float64).reshape(2, 3).t(),
        "a": torch.ones(3, dtype=torch.bfloat16),
    }

    def record(name: str, t: torch.Tensor) -> bytes:
        raw = (
            t.contiguous().view(torch.uint8).numpy().tobytes()
            if t.dtype == torch.bfloat16
            else t.contiguous().numpy().tobytes()
        )
        dtype = {torch.float64: b"float64", torch.bfloat16: b"bfloat16"}[t.dtype]
        return (
            b"detrl/tensor/v3\0" + struct.pack("<I", len(name)) + name.encode() + struct.pack("<I", len(dtype))
            + dtype + struct.pack("<I", t.dim()) + b"".join(struct.pack("<Q", n) for n in t.shape)
            + struct.pack("<Q", len(raw)) + blake3.blake3(raw).digest()
        )  # fmt: skip

    body = b"detrl/state/v3\0" + struct.pack("<Q", 2) + record("a", tensors["a"]) + record("b", tensors["b"])
    body += struct.pack("<Q", 1) + struct.pack("<I", 7) + b"sources" + struct.pack("<Q", 3) + b"xyz"
    assert commit.state_hash(tensors, b"xyz", {}) == blake3.blake3(body).digest()
    assert commit.state_hash(tensors, b"xyz", {}, commit.DigestCache()) == blake3.blake3(body).digest()
    assert commit.tensor_digest("b", tensors["b"]) == blake3.blake3(record("b", tensors["b"])).digest()


def test_state_encoding_separates_tensors_from_extras_and_names_from_blobs() -> None:
    a = torch.ones(2)
    base = commit.hash_tensors({"a": a}, [("x", b"12")])
    others = [
        commit.hash_tensors({}, [("x", b"12")]),
        commit.hash_tensors({"a": a}, []),
        commit.hash_tensors({"a": a}, [("x1", b"2")]),  # name/blob boundary moved
        commit.hash_tensors({"a": a}, [("x", b"1"), ("", b"2")]),
        commit.hash_tensors({"b": a}, [("x", b"12")]),
        commit.hash_tensors({"a": a}, [("x", b"12")], tag=commit.BATCH_TAG),
    ]
    assert all(o != base for o in others) and len(set(others)) == len(others)


def test_tags_are_prefix_free() -> None:
    tags = [commit.TENSOR_TAG, commit.STATE_TAG, commit.BATCH_TAG, commit.LEAF_TAG, commit.NODE_TAG]
    for a, b in itertools.permutations(tags, 2):
        assert not b.startswith(a)


def test_merkle_leaves_and_nodes_are_separated() -> None:
    s, b = bytes(32), bytes(range(32))
    l0, l1 = commit.leaf(0, s, b), commit.leaf(1, s, b)
    assert l0 != l1 and commit.leaf(0, b, s) != l0
    root2 = commit.merkle_root([l0, l1])
    assert root2 != commit.merkle_root([l1, l0]) and root2 != commit.merkle_root([l0])
    assert commit.merkle_root([l0, l1, l0]) != root2 and commit.merkle_root([]) != commit.merkle_root([l0])


def _state(n: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(n)]).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    return model, opt


def _hash(model: torch.nn.Module, opt: torch.optim.Optimizer, cache: commit.DigestCache | None) -> bytes:
    return commit.state_hash(commit.state_tensors(model, [opt]), b"src", {}, cache)


def _versions(model: torch.nn.Module) -> list[int]:
    return [p._version for p in model.parameters()]


def test_cache_reuses_unchanged_digests_and_catches_foreach_writes_under_no_version_bump() -> None:
    """``_foreach_add_`` on ``.data`` writes the parameters without bumping their version counters; the
    cache must still rehash them, and its commitment must equal a cache-free one at every step."""
    model, opt = _state()
    cache = commit.DigestCache()
    first = _hash(model, opt, cache)
    assert _hash(model, opt, cache) == first and cache.hits == cache.misses  # second pass: all reused
    versions = _versions(model)
    with torch.no_grad():
        torch._foreach_add_([p.data for p in model.parameters()], 2.0**-40)  # below FP32's resolution
    assert _versions(model) == versions, "the write this test relies on now bumps version counters"
    changed = _hash(model, opt, cache)
    assert changed != first and changed == _hash(model, opt, None)


@pytest.mark.parametrize("mode", ["foreach", "fused"])
def test_cache_matches_uncached_hash_through_optimizer_steps(mode: str) -> None:
    model, _ = _state()
    kw = {mode: True}
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, **kw)
    cache = commit.DigestCache()
    x = torch.randn(4, 8, dtype=torch.float64)
    seen = {_hash(model, opt, cache)}
    for i in range(6):
        if i % 2 == 0:  # every other step writes nothing (the DQN's acting-only steps)
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
        h = _hash(model, opt, cache)
        assert h == _hash(model, opt, None)
        assert (h in seen) == (i % 2 == 1)
        seen.add(h)


def test_cache_single_element_change_in_a_large_tensor() -> None:
    t = torch.zeros(1 << 16, dtype=torch.float64)
    cache = commit.DigestCache()
    d0 = cache.record("t", t)
    for idx in (0, 12345, (1 << 16) - 1):
        t.view(torch.int64)[idx] ^= 1  # one bit of one element, through an integer view
        d = cache.record("t", t)
        assert d != d0 and d == commit.tensor_record("t", t)
        d0 = d


def test_cache_detects_dtype_and_shape_change_with_same_bytes() -> None:
    cache = commit.DigestCache()
    x = torch.arange(4, dtype=torch.float32)
    cache.record("w", x)
    assert cache.record("w", x.view(torch.int32)) == commit.tensor_record("w", x.view(torch.int32))
    assert cache.record("w", x.reshape(2, 2)) == commit.tensor_record("w", x.reshape(2, 2))


def test_cache_budget_and_drop_rule() -> None:
    """Copies stay under the budget; a tensor that changes at every commitment loses its copy and gets
    one back after the backoff; digests stay right throughout."""
    cache = commit.DigestCache(budget_bytes=1000, drop_after=2)
    big = torch.zeros(200, dtype=torch.float64)  # 1600 bytes: never copied
    small = torch.zeros(50, dtype=torch.float64)  # 400 bytes
    for _ in range(40):
        small += 1.0
        assert cache.record("big", big) == commit.tensor_record("big", big)
        assert cache.record("small", small) == commit.tensor_record("small", small)
        assert cache.copy_bytes <= cache.budget_bytes
    assert cache.hits == 0
    # Once it stops changing it is copied again (after at most the first backoffs) and then reused.
    for _ in range(40):
        cache.record("small", small)
    assert cache.hits > 0 and cache._entries["small"].copy is not None
    assert cache._entries["big"].copy is None


def test_cache_follows_storage_swaps_and_in_place_layout_changes() -> None:
    """The cache reads a tensor through a view it keeps: a swapped storage (``p.data = ...``) or an in-place
    transpose (same memory, same shape, other strides) must be seen through, not read via the old view."""
    p = torch.nn.Parameter(torch.arange(9, dtype=torch.float64).reshape(3, 3))
    cache = commit.DigestCache()
    for _ in range(2):
        cache.record("p", p)
    p.data = torch.arange(9, dtype=torch.float64).reshape(3, 3) + 1.0
    assert cache.record("p", p) == commit.tensor_record("p", p)
    t = torch.arange(9, dtype=torch.float64).reshape(3, 3)
    cache.record("t", t)
    t.t_()
    assert cache.record("t", t) == commit.tensor_record("t", t) != commit.tensor_record("t", t.t())


def test_an_optimizer_state_that_is_not_tensors_and_numbers_is_refused_in_one_line(tmp_path) -> None:
    """L-BFGS keeps lists (its curvature history): ``Session.track`` refuses it, and a state value of any
    other type is named when a commitment meets it (it crashed in ``float()``)."""

    from detrl.core.engine import Session
    from detrl.core.sources import Sources
    from detrl.formats.commit import optimizer_tensors

    session = Session(tmp_path / "run", mode="record", sources=Sources(), planned_steps=1, checkpoint_every=0)
    with session:
        model = session.init(lambda: torch.nn.Linear(2, 1))
        with pytest.raises(ValueError, match=r"^LBFGS keeps its curvature history as lists"):
            session.track(torch.optim.LBFGS(model.parameters()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.state[model.weight]["history"] = [torch.zeros(1)]
    with pytest.raises(ValueError, match=r"SGD: state 'history' of weight is a list"):
        optimizer_tensors(opt, {id(model.weight): "weight"})


def test_cache_follows_a_swap_of_a_tensor_written_at_every_commitment() -> None:
    """A tensor written at every commitment has no copy (the drop rule) and is rehashed through the view the
    cache keeps: a swapped storage, an in-place transpose or a resize must still be seen through."""
    p = torch.nn.Parameter(torch.arange(12, dtype=torch.float64).reshape(3, 4))
    cache = commit.DigestCache(drop_after=2)
    for _ in range(5):
        with torch.no_grad():
            p.add_(1.0)
        assert cache.record("p", p) == commit.tensor_record("p", p)
    entry = cache._entries["p"]
    assert entry.copy is None and entry.retry_in > 0  # the steady state of a written tensor
    p.data = torch.arange(12, dtype=torch.float64).reshape(3, 4) * 2.0  # another storage
    assert cache.record("p", p) == commit.tensor_record("p", p)
    with torch.no_grad():
        p.add_(1.0)
    assert cache.record("p", p) == commit.tensor_record("p", p)
    t = p.data
    t.t_()  # same memory, other strides
    assert cache.record("p", t) == commit.tensor_record("p", t)
    with torch.no_grad():
        t.resize_(2, 2)  # same storage, fewer elements
    assert cache.record("p", t) == commit.tensor_record("p", t)


def test_the_state_records_helper_is_built_where_a_cpp_compiler_exists() -> None:
    """``pip install`` builds it (``setup.py``: optional, so a compile error is no install error), else the
    first use does: where a compiler exists, a source that does not compile fails here, not as skips."""
    import shutil

    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the digest cache and the state tensor cache take their Python paths")
    assert extensions.steady_records() is not None and extensions.same_listing() is not None


def test_a_build_lock_left_by_a_killed_build_is_cleared_and_a_live_one_kept(tmp_path, capsys) -> None:
    """Torch waits without end on a build lock; a first-use build killed midway leaves one. detrl removes a
    lock older than any build takes, in one line, and keeps a younger one (another process building)."""
    import os
    import time

    lock = tmp_path / "lock"
    assert not extensions.clear_stale_lock(tmp_path)  # no lock
    lock.write_text("")
    assert not extensions.clear_stale_lock(tmp_path) and lock.exists()  # a build in progress
    old = time.time() - extensions.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    assert extensions.clear_stale_lock(tmp_path) and not lock.exists()
    assert "removed a build lock left 11 minutes ago" in capsys.readouterr().err


def test_first_use_builds_go_to_one_folder_per_python_and_torch(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    path = extensions.build_directory("detrl_core__state_records")
    assert path.is_dir() and path.parent.parent == tmp_path and torch.__version__ in path.parent.name


def _steady_records() -> type:
    from detrl.core import extensions

    steady = extensions.steady_records()
    if steady is None:
        pytest.skip("the state records extension is not built (no C++ compiler)")
    return steady


def test_steady_plan_gives_the_records_and_counters_of_the_per_tensor_path() -> None:
    """The one-call rehash of a state's steady tensors (``DigestCache(steady=...)``) gives the state hash of
    the per-tensor path at every commitment, through storage swaps, in-place transposes and resizes, tensors
    added, dropped and replaced, and tensors that stop changing; and leaves every entry's counters as that
    path does."""
    steady = _steady_records()
    made = []

    def counting(*args: object) -> object:
        made.append(1)
        return steady(*args)

    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(i + 2, 3, dtype=torch.float64) for i in range(6)}
    state["half"] = torch.randn(5, dtype=torch.float32).to(torch.bfloat16)
    state["count"] = torch.zeros((), dtype=torch.int64)
    fast, slow = commit.DigestCache(drop_after=2, steady=counting), commit.DigestCache(drop_after=2)
    plan_calls = 0
    for step in range(400):
        with torch.no_grad():
            for i, t in enumerate(state.values()):
                if not (step >= 200 and i % 3 == 0):  # from step 200 a third of them stop changing
                    t.add_(1)
        if step == 30:
            state["w1"].data = torch.randn(3, 3, dtype=torch.float64)  # another storage, same tensor object
        if step == 50:
            state["w2"].t_()  # same memory, other strides
        if step == 70:
            state["w3"].resize_(2, 3)  # same storage, fewer elements
        if step == 90:
            state["extra"] = torch.ones(4, dtype=torch.float64)
        if step == 110:
            del state["extra"]
        if step == 130:
            state["w4"] = state["w4"].clone()  # another tensor under the same name
        plan_calls += fast._plan is not None
        want = commit.hash_tensors(state)
        given = types.MappingProxyType(state) if step == 150 else state  # a mapping that is not a dict
        assert commit.hash_tensors(given, cache=fast) == commit.hash_tensors(state, cache=slow) == want, step
    assert len(made) > 5 and plan_calls > 200  # the plan served most commitments, and was remade
    assert (fast.hits, fast.misses) == (slow.hits, slow.misses)
    if fast._plan is not None:
        fast._settle()
    for name in state:
        a, b = fast._entries[name], slow._entries[name]
        assert (a.record, a.retry_in, a.changed_run, a.backoff, a.copy is None) == (
            b.record,
            b.retry_in,
            b.changed_run,
            b.backoff,
            b.copy is None,
        ), name


def test_steady_records_decline_a_changed_state() -> None:
    """``SteadyRecords.records`` gives the records ``tensor_record`` gives, and None for a state that is not
    the one it was made for: a name missing or added, another tensor object, or the same one with other
    memory, strides or sizes."""
    steady = _steady_records()
    t = {"a": torch.arange(6, dtype=torch.float64).reshape(2, 3), "b": torch.ones(3, dtype=torch.float32)}
    names = sorted(t)
    views = [commit.tensor_bytes(t[n]) for n in names]
    headers = [
        commit._record_header(n, t[n].dtype, tuple(t[n].shape), v.nbytes) for n, v in zip(names, views)
    ]
    plan = steady(names, [t[n] for n in names], headers, views, commit._hasher, len(names))
    assert plan.records(t) == [commit.tensor_record(n, t[n]) for n in names]
    with torch.no_grad():
        t["a"].mul_(3.0)  # written in place: the same memory, read anew
    assert plan.records(t) == [commit.tensor_record(n, t[n]) for n in names]
    assert plan.records({"a": t["a"]}) is None
    assert plan.records({**t, "c": t["b"]}) is None
    assert plan.records({"a": t["a"], "b": t["b"].clone()}) is None
    a = t["a"]
    a.t_()
    assert plan.records(t) is None
    a.t_()
    assert plan.records(t) is not None
    a.resize_(1, 3)
    assert plan.records(t) is None
    a.data = torch.zeros(2, 3, dtype=torch.float64)
    assert plan.records(t) is None


def _net_and_adam() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    net.register_buffer("scale", torch.ones(2))
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    return net, opt


def _train_step(net: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    net(torch.randn(3, 4)).square().sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _same_listing(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return list(got) == list(want) and all(got[k] is want[k] for k in want)


@pytest.fixture(params=["python", "native"])
def new_cache(request) -> Callable[[], commit.StateTensorCache]:
    """A StateTensorCache with its Python check, or with the native one (detrl/core/state_records.cpp)."""
    if request.param == "python":
        return commit.StateTensorCache
    same_listing = extensions.same_listing()
    if same_listing is None:
        pytest.skip("the state records extension is not built")
    return lambda: commit.StateTensorCache(same_listing)


def test_the_state_tensor_cache_answers_as_state_tensors_and_walks_the_model_once_in_a_loop(
    new_cache,
) -> None:
    net, opt = _net_and_adam()
    cache = new_cache()
    for _ in range(5):
        _train_step(net, opt)
        got = cache(net, [opt])
        assert _same_listing(got, commit.state_tensors(net, [opt]))
        got.clear()  # each call's dict is the caller's
    assert cache.rebuilds == 1
    assert len(cache(net, [opt])) == len(commit.state_tensors(net, [opt])) > 0


def _replace_weight(net, opt):
    net[0].weight = torch.nn.Parameter(net[0].weight.detach().clone())


def _new_buffer(net, opt):
    net[1].register_buffer("extra", torch.zeros(1))


def _buffer_gone(net, opt):
    del net._buffers["scale"]


def _new_submodule(net, opt):
    net[1].add_module("inner", torch.nn.Linear(1, 1))


def _equal_state_in_a_new_tensor(net, opt):  # same values, a new object: equality must not be asked
    state = opt.state[net[0].bias]
    state["step"] = state["step"].clone()


def _state_reloaded(net, opt):  # load_state_dict builds a new opt.state
    opt.load_state_dict(opt.state_dict())


def _class_changed(net, opt):
    net[1].__class__ = type("Norm", (torch.nn.LayerNorm,), {})


@pytest.mark.parametrize(
    "change",
    [_replace_weight, _new_buffer, _buffer_gone, _new_submodule, _equal_state_in_a_new_tensor, _state_reloaded,
     _class_changed],
)  # fmt: skip
def test_the_state_tensor_cache_sees_every_change_to_what_the_listing_reads(change, new_cache) -> None:
    net, opt = _net_and_adam()
    cache = new_cache()
    _train_step(net, opt)
    cache(net, [opt])
    cache(net, [opt])
    assert cache.rebuilds == 1
    change(net, opt)
    assert _same_listing(cache(net, [opt]), commit.state_tensors(net, [opt]))
    assert cache.rebuilds == 2


def test_the_state_tensor_cache_reads_afresh_where_it_cannot_check(new_cache) -> None:
    """A module class that lists its own parameters, a number in an optimizer's state, and another model or
    optimizer object: every call walks them."""

    class Listing(torch.nn.Linear):
        def named_parameters(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            return super().named_parameters(*args, **kwargs)

    net, opt = _net_and_adam()
    net.append(Listing(2, 2))
    cache = new_cache()
    for _ in range(3):
        assert _same_listing(cache(net), commit.state_tensors(net))
    assert cache.rebuilds == 3

    net, opt = _net_and_adam()
    sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    _train_step(net, sgd)
    sgd.state[net[0].weight]["count"] = 1  # a number: committed as a new 0-d tensor each time
    for _ in range(2):
        assert cache(net, [sgd])["0.opt.0.weight.count"].item() == 1.0
    assert cache.rebuilds == 5

    other = torch.optim.Adam(net.parameters())
    cache(net, [opt])
    cache(net, [other])
    cache(_net_and_adam()[0], [other])
    assert cache.rebuilds == 8


def _equal_listing(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_a_loop_found_uncacheable_is_not_walked_a_second_time_to_check(monkeypatch, new_cache) -> None:
    """Once a model and its optimizers cannot be cached, each call only lists them: the check's own walk is
    not repeated, the listing still follows every change, and another loop is cached again."""
    snapshots = []
    snapshot = commit.StateTensorCache._snapshot
    monkeypatch.setattr(commit.StateTensorCache, "_snapshot", lambda *a: snapshots.append(1) or snapshot(*a))
    net, _ = _net_and_adam()
    sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    _train_step(net, sgd)
    sgd.state[net[0].weight]["count"] = 1
    cache = new_cache()
    for _ in range(3):
        assert _equal_listing(cache(net, [sgd]), commit.state_tensors(net, [sgd]))
    _new_buffer(net, sgd)
    assert _equal_listing(cache(net, [sgd]), commit.state_tensors(net, [sgd]))
    assert "buffer.1.extra" in cache(net, [sgd])
    assert len(snapshots) == 1

    other, adam = _net_and_adam()
    _train_step(other, adam)
    for _ in range(3):
        assert _same_listing(cache(other, [adam]), commit.state_tensors(other, [adam]))
    assert len(snapshots) == 2 and cache.rebuilds == 6


# ------------------------------------------------------------------ rules revision 13: every NaN as one NaN
#: Every dtype with more than one NaN: IEEE's floats, complex numbers' parts, and the FP8 formats that have a
#: sign on their NaN.
_NAN_DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex128, torch.complex64,
    torch.float8_e5m2, torch.float8_e4m3fn,
]  # fmt: skip


def _words(dtype: torch.dtype) -> torch.dtype:
    """The signed integer dtype of one element (a complex number's part)."""
    size = torch.empty((), dtype=dtype).element_size() // (2 if dtype.is_complex else 1)
    return {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]


def _part(dtype: torch.dtype) -> torch.dtype:
    return dtype.to_real() if dtype.is_complex else dtype


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(_NAN_DTYPES),
    st.binary(min_size=0, max_size=96),
    st.lists(st.integers(min_value=0, max_value=47), max_size=12),
)
def test_nans_canonical_takes_every_nan_as_the_one_nan_and_leaves_every_other_bit(
    dtype: torch.dtype, raw: bytes, at: list[int]
) -> None:
    """Random elements, some with their exponent bits all set (NaNs of any sign and payload, infinities):
    every element torch calls a NaN becomes the bits of ``float("nan")`` in that dtype, every other element
    keeps its bits, and bytes without a NaN come back as the very array given."""
    part, words = _part(dtype), _words(dtype)
    element = torch.empty((), dtype=dtype).element_size()
    raw = raw[: len(raw) // element * element]
    if not raw:
        empty = np.zeros(0, dtype=np.uint8)
        assert commit.nans_canonical(empty, dtype) is empty
        return
    w = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(words).clone()  # one word a part
    top = torch.tensor(math.inf if part.is_floating_point and part != torch.float8_e4m3fn else math.nan)
    top_bits = top.to(part).view(words)  # the exponent bits all set (e4m3fn has no infinity: its NaN)
    for i in at:
        if i < w.numel():
            w[i] |= top_bits
    data = w.view(torch.uint8).numpy()
    got = commit.nans_canonical(data, dtype)
    values, after = w.view(part).float(), torch.from_numpy(got.copy()).view(words)
    nan = values.isnan()
    one_nan = torch.tensor(math.nan).to(part).view(words)
    assert torch.equal(after[nan], one_nan.expand(int(nan.sum())))
    assert torch.equal(after[~nan], w[~nan])
    if not bool(nan.any()):
        assert got is data
    else:
        assert got is not data and torch.equal(torch.from_numpy(data).view(words), w)  # the input unchanged


def test_records_take_nans_as_one_only_where_asked() -> None:
    """Two tensors that differ only in their NaNs' signs and payloads have one record under
    ``canonical_nans``, and differing records without it; other dtypes are hashed as they are."""
    a = torch.tensor([1.0, math.nan, -math.inf, 0.0], dtype=torch.float64)
    b = a.clone()
    b.view(torch.int64)[1] = -(2**63) + 0x7FF0_0000_0000_0001  # a negative signalling NaN
    assert a.isnan()[1] and b.isnan()[1]
    one = functools.partial(commit.tensor_record, canonical_nans=True)
    assert one("t", a) == one("t", b)
    assert commit.tensor_record("t", a) != commit.tensor_record("t", b)
    assert commit.tensor_record("t", a, canonical_nans=True) == commit.tensor_record("t", a)  # float("nan")'s
    ints = torch.tensor([-1, 2**62], dtype=torch.int64)
    assert commit.tensor_record("i", ints, canonical_nans=True) == commit.tensor_record("i", ints)
    with pytest.raises(ValueError, match="takes NaNs otherwise"):
        commit.hash_tensors({"t": a}, cache=commit.DigestCache(), canonical_nans=True)


@pytest.mark.parametrize("native", [False, True])
def test_a_cache_that_takes_nans_as_one_gives_the_uncached_hash_as_nans_come_and_go(native: bool) -> None:
    """A state whose NaNs change sign and payload from commitment to commitment (as another machine's
    arithmetic would write them) hashes as the uncached ``canonical_nans`` hash at every commitment, through
    the steady tensors' one-call path (``SteadyRecords``, which tests each tensor for a NaN itself) and the
    per-tensor one; and the same states written with other NaN bits hash alike."""
    steady = _steady_records() if native else None
    torch.manual_seed(0)
    dtypes = [torch.float64, torch.float32] * 3
    state = {f"w{i}": torch.randn(64, dtype=dtype) for i, dtype in enumerate(dtypes)}
    state["b"] = torch.randn(8).to(torch.bfloat16)
    cache = commit.DigestCache(drop_after=2, steady=steady, canonical_nans=True)
    other = commit.DigestCache(drop_after=2, steady=steady, canonical_nans=True)
    twin = {name: t.clone() for name, t in state.items()}  # written in place: steady tensors too
    planned = 0
    for step in range(60):
        with torch.no_grad():
            for i, t in enumerate(state.values()):
                t.add_(1)
                if step % 7 == i % 7:
                    t[step % t.numel()] = math.nan
        for name, t in twin.items():  # the same values, each NaN with the sign bit flipped
            t.copy_(state[name])
            words = t.view(_words(t.dtype))
            words[t.isnan()] ^= torch.tensor(-1, dtype=words.dtype) << (8 * words.element_size() - 1)
        want = commit.hash_tensors(state, canonical_nans=True)
        assert (want != commit.hash_tensors(twin)) is any(bool(t.isnan().any()) for t in state.values())
        planned += cache._plan is not None and other._plan is not None
        assert commit.hash_tensors(state, cache=cache, canonical_nans=True) == want, step
        assert commit.hash_tensors(twin, cache=other, canonical_nans=True) == want, step
    assert (planned > 20) is native  # the one-call path served the commitments


def test_a_commitment_leaves_every_storage_resizable() -> None:
    """Reading a tensor's bytes for a record does not mark its storage as never resizable (as
    ``Tensor.numpy()`` does): a model that resizes a buffer in place after a commitment can."""
    t = {
        "empty": torch.zeros(0, dtype=torch.float64),
        "w": torch.ones(3),
        "half": torch.ones(2).to(torch.bfloat16),
    }
    cache = commit.DigestCache(steady=extensions.steady_records())
    for _ in range(4):
        commit.hash_tensors(t, cache=cache)
        commit.hash_batch(t["w"])
    assert all(v.untyped_storage().resizable() for v in t.values())
    t["empty"].resize_(5).fill_(
        2.0
    )  # as torch.ao.quantization's per-channel observers do at their first batch
    assert commit.hash_tensors(t, cache=cache) == commit.hash_tensors(t)


class _ResizesABuffer(torch.nn.Module):
    """A layer whose buffer starts empty and takes its size from the first batch, resized in place (as
    ``torch.ao.quantization``'s per-channel observers do), and tracks each feature's running maximum."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 5)
        self.register_buffer("running_max", torch.tensor([]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, 16) -> (N, 5)
        with torch.no_grad():
            if self.running_max.numel() == 0:
                self.running_max.resize_(x.shape[1]).fill_(-math.inf)
            torch.maximum(self.running_max, x.amax(0), out=self.running_max)
        return self.fc(x)


def test_a_model_that_resizes_a_buffer_after_its_first_commitment_records_and_replays(tmp_path) -> None:
    """The initial state's commitment (and a checkpoint at every step) came before the buffer's resize: it
    raised "Trying to resize storage that is not resizable" at the first step, in any precision."""
    from detrl.core.engine import Session
    from detrl.core.sources import Sources
    from detrl.testing import zoo

    specimen = zoo.Specimen("resizes_a_buffer", _ResizesABuffer, zoo.features, zoo.classify)
    run = Session(tmp_path / "run", mode="record", sources=Sources(), planned_steps=2, checkpoint_every=1)
    recorded = zoo.train(run, specimen, steps=2)
    assert recorded.model.running_max.shape == (16,) and bool(recorded.model.running_max.isfinite().all())
    replayed = zoo.replay(specimen, tmp_path / "run", "emulated:splitk", steps=2)
    assert torch.equal(replayed.model.running_max, recorded.model.running_max)


def test_a_batch_of_dicts_lists_and_none_is_hashed_by_path() -> None:
    """``Session.step(batch=...)`` takes a Hugging Face batch (a dict), nested tuples and ``None``: each leaf is
    named by its path, so moving a tensor to another key or changing any value changes the digest. A flat
    batch hashes as it always did (the same records, no extras), and an object that is none of those is
    refused in one line."""
    ids, mask = torch.tensor([[1, 2, 3]]), torch.tensor([[1, 1, 0]])
    assert commit.hash_batch(ids, mask) == commit.hash_tensors({"0": ids, "1": mask}, tag=commit.BATCH_TAG)
    assert commit.hash_batch(ids, [1, 2]) == commit.hash_batch(ids, torch.tensor([1, 2]))  # as before
    batch = {"input_ids": ids, "attention_mask": mask, "labels": None}
    digest = commit.hash_batch(batch)
    assert digest == commit.hash_batch(dict(batch))
    assert digest != commit.hash_batch({"input_ids": mask, "attention_mask": ids, "labels": None})
    assert digest != commit.hash_batch({**batch, "labels": ids})
    assert digest != commit.hash_batch({"input_ids": ids, "attention_mask": mask})
    assert digest != commit.hash_batch({**batch, "attention_mask": torch.tensor([[1, 0, 0]])})
    nested = ((ids, torch.ones(4, 2), None), "a prompt")
    assert commit.hash_batch(*nested) != commit.hash_batch((ids, torch.ones(4, 2), None), "another")
    assert commit.hash_batch(*nested) != commit.hash_batch((ids, torch.zeros(4, 2), None), "a prompt")
    with pytest.raises(TypeError, match=r"cannot hash the batch's object at 1\['x'\]"):
        commit.hash_batch(ids, {"x": object()})
