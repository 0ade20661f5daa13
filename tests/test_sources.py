"""The switchboard: named streams, independent seeds, state round trip, stream-driven random ops."""

import random

import numpy as np
import pytest
import torch

from detrl import Session, Sources
from detrl.core.randomness import StreamRandomMode
from detrl.core.sources import STREAMS, derive_seed, state_bytes


def test_each_stream_has_its_own_seed_derived_from_base_and_name():
    s = Sources(seed=0)
    seeds = [s.seed_of(n) for n in STREAMS]
    assert len(set(seeds)) == len(STREAMS)
    assert s.seed_of("init") == derive_seed(0, "init")
    assert Sources(seed=1).seed_of("init") != s.seed_of("init")


def test_changing_one_stream_leaves_the_others_untouched():
    a = Sources(seed=0)
    b = Sources(seed=0, streams={"dropout": {"seed": 7}})
    assert b.seed_of("dropout") == 7
    for name in STREAMS:
        if name != "dropout":
            assert torch.equal(a.permutation(name, 50), b.permutation(name, 50)), name
    assert not torch.equal(a.permutation("dropout", 50), b.permutation("dropout", 50))


def test_unseeded_stream_draws_fresh_seed_and_records_it():
    a, b = Sources(streams={"explore": {"seed": None}}), Sources(streams={"explore": {"seed": None}})
    assert a.seed_of("explore") != b.seed_of("explore")
    restored = Sources()
    restored.load_state_dict(a.state_dict())
    assert restored.seed_of("explore") == a.seed_of("explore")


def test_state_round_trip_resumes_streams_exactly():
    a = Sources(seed=3)
    a.permutation("data_order", 10)
    a.numpy("replay").integers(0, 100, 5)
    b = Sources()
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.permutation("data_order", 100), b.permutation("data_order", 100))
    assert (a.numpy("replay").integers(0, 1000, 10) == b.numpy("replay").integers(0, 1000, 10)).all()
    assert a.digest_bytes() == b.digest_bytes()


def test_the_commitment_bytes_are_the_canonical_json_of_the_state():
    """``digest_bytes`` writes the generators' base64 states into the JSON of the rest (a shortcut): the
    same bytes as the canonical JSON of ``state_dict`` with no stream, one, and several of each kind, before
    and after they draw, seeded or not; and they change when a stream draws."""
    a = Sources(seed=5, streams={"explore": {"seed": None}})
    seen = [a.digest_bytes()]
    assert seen[0] == state_bytes(a.state_dict())
    for draw in (
        lambda: a.torch("init"),
        lambda: torch.rand(3, generator=a.torch("dropout")),
        lambda: a.numpy("replay").integers(0, 9, 4),
        lambda: a.permutation("data_order", 7),
        lambda: torch.rand(3, generator=a.torch("explore")),
    ):
        draw()
        seen.append(a.digest_bytes())
        assert seen[-1] == state_bytes(a.state_dict())
    assert len(set(seen)) == len(seen)


def test_the_kept_json_frame_follows_every_change_of_the_rest_of_the_state():
    """``digest_bytes`` keeps the JSON around the torch streams' states: a load that changes the base seed,
    the bitflip switch, the seeds and the unseeded streams, a numpy stream's draw and a new stream each give
    the canonical JSON of the state as it is then, never the frame of the call before."""
    a = Sources(seed=1)
    torch.rand(2, generator=a.torch("dropout"))
    seen = [a.digest_bytes()]
    other = Sources(seed=2, streams={"explore": {"seed": None}, "replay": {"seed": 11}}, bitflip=True)
    torch.rand(2, generator=other.torch("init"))
    other.numpy("env").integers(0, 5, 3)
    for change in (
        lambda: a.load_state_dict(other.state_dict()),
        lambda: a.numpy("env").integers(0, 5, 1),
        lambda: a.torch("explore"),
        lambda: a.numpy("replay"),
    ):
        change()
        seen.append(a.digest_bytes())
        assert seen[-1] == state_bytes(a.state_dict())
    assert len(set(seen)) == len(seen)


def test_a_streams_encoded_state_is_reused_only_while_the_state_is_the_same():
    """The switchboard keeps each torch stream's last state and base64 (re-encoding an unchanged stream at
    every commitment cost more than the rest of the bytes): what it writes is always the fresh encoding of
    the stream's state, after a draw, a rewind to an earlier state and a load alike."""
    import base64

    a = Sources(seed=7)
    g = a.torch("dropout")

    def fresh() -> str:
        return base64.b64encode(g.get_state().numpy().tobytes()).decode()

    start = g.get_state()
    first = a.state_dict()["torch"]["dropout"]
    assert first == fresh() and a.state_dict()["torch"]["dropout"] is first  # unchanged: the same string
    torch.rand(5, generator=g)
    assert a.state_dict()["torch"]["dropout"] == fresh() != first
    g.set_state(start)  # back to the first state
    assert a.state_dict()["torch"]["dropout"] == fresh() == first
    other = Sources(seed=8)
    torch.rand(2, generator=other.torch("dropout"))
    a.load_state_dict(other.state_dict())
    g = a.torch("dropout")
    assert a.state_dict()["torch"]["dropout"] == fresh() == other.state_dict()["torch"]["dropout"]
    assert a.digest_bytes() == other.digest_bytes() == state_bytes(a.state_dict())


def test_bad_state_and_unknown_streams_are_clear_errors():
    with pytest.raises(ValueError, match="unknown random stream"):
        Sources(streams={"nope": {"seed": 1}})
    with pytest.raises(ValueError, match="unknown key sources.bogus"):
        Sources.from_config({"seed": 0, "bogus": {"seed": 1}})
    with pytest.raises(ValueError, match="invalid switchboard state"):
        Sources().load_state_dict({"seeds": {"init": "x"}, "seed": 0})


def test_bitflip_moves_one_weight_to_its_neighbouring_float():
    torch.manual_seed(0)
    m1 = torch.nn.Linear(4, 3)
    m2 = torch.nn.Linear(4, 3)
    m2.load_state_dict(m1.state_dict())
    where = Sources(seed=0, bitflip=True).apply_bitflip(m2)
    assert where is not None
    diffs = [
        (n, (p1 != p2).sum().item()) for (n, p1), (_, p2) in zip(m1.named_parameters(), m2.named_parameters())
    ]
    assert sum(d for _, d in diffs) == 1
    assert Sources(seed=0).apply_bitflip(m2) is None


def test_random_ops_in_a_step_draw_from_the_stream_not_the_global_rng():
    def draw(stream_seed, global_seed):
        torch.manual_seed(global_seed)
        g = torch.Generator().manual_seed(stream_seed)
        with StreamRandomMode(g):
            x = torch.nn.functional.dropout(torch.ones(64, dtype=torch.float64), 0.5)
            rrelu = torch.nn.functional.rrelu(torch.linspace(-1, 1, 8, dtype=torch.float64), training=True)
            return x, torch.rand(5), torch.randperm(7), torch.empty(4).bernoulli_(0.5), torch.randn(3), rrelu

    a, b, c = draw(1, 0), draw(1, 99), draw(2, 0)
    assert all(torch.equal(u, v) for u, v in zip(a, b))  # the global seed does not matter
    assert not torch.equal(a[0], c[0])  # the stream does


def test_random_op_without_a_handler_is_refused():
    with StreamRandomMode(torch.Generator()), pytest.raises(RuntimeError, match="no switchboard stream"):
        torch.rand(3, out=torch.empty(3))  # aten.rand.out: no handler


class _HostRandomNet(torch.nn.Module):
    """Masks its hidden units by ``np.random`` and, by Python's ``random``, skips a layer or not: model code
    that draws from the host's global RNGs inside a step (wav2vec2's SpecAugment, layer drop)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(8, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        h = h * torch.from_numpy(np.random.rand(16) < 0.5).to(h.dtype)
        if random.random() < 0.5:
            h = torch.relu(self.b(h))
        return self.c(h)


def _host_random_run(session, steps: int = 4) -> Session:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g)
    with session:
        model = session.init(_HostRandomNet)
        opt = session.track(torch.optim.SGD(model.parameters(), lr=0.1))
        done = session.restore() if session.mode == "replay" else 0
        for _ in range(done, steps):
            if session.stop_requested:
                break
            xb = x.to(session.precision.dtype)
            with session.step(batch=(xb, y)):
                loss = torch.nn.functional.cross_entropy(model(xb), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
    return session


def test_model_code_drawing_from_random_and_numpy_replays_from_any_checkpoint(tmp_path):
    """Each step seeds ``random`` and ``np.random`` from the dropout stream and the step: a replay on
    another profile, from step 0 or from a checkpoint, draws what the recording drew, whatever state the
    auditor's process left them in. Unseeded (the old engine), a replay in a fresh process diverged."""
    rec = _host_random_run(Session(tmp_path / "run", mode="record", sources=Sources(), checkpoint_every=2))
    np.random.seed(12345)  # the auditor's process: any state
    random.seed(678)
    full = _host_random_run(Session(tmp_path / "run", mode="replay", hardware="emulated:splitk"))
    segment = _host_random_run(
        Session(tmp_path / "run", mode="replay", hardware="emulated:reversed", start=2)
    )
    assert full.leaves == rec.leaves and segment.leaves == rec.leaves
    assert segment.step_index == 4


def test_the_dropout_stream_decides_the_host_draws_and_the_session_restores_them(tmp_path):
    def weights(seed: int, name: str) -> list[torch.Tensor]:
        run = Session(tmp_path / name, mode="record", sources=Sources(streams={"dropout": {"seed": seed}}))
        return list(_host_random_run(run, steps=1).model.parameters())

    np.random.seed(5)
    random.seed(6)
    want = (np.random.rand(), random.random())
    np.random.seed(5)
    random.seed(6)
    a, b, c = weights(1, "a"), weights(1, "b"), weights(2, "c")  # one init: only the host draws differ
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert not all(torch.equal(p, q) for p, q in zip(a, c))
    assert (np.random.rand(), random.random()) == want  # the user's own streams, as they were
