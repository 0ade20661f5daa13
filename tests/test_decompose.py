"""Layer norm and softmax decompositions (detrl/core/decompose.py): torch's kernels mathematically, and in
verifiable precision only their sums and exponentials reach the log."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from detrl.core import decompose
from detrl.core.hardware import get_profile
from detrl.core.rounding import RoundingMode, StepRounding, Thresholds

aten = torch.ops.aten
PLAIN = decompose.Steps(lambda t, dims: t.sum(dims))


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _assert_close(out: object, ref: object) -> None:
    """Same structure, shapes and dtypes; values within 1e-12 of the reference's scale."""
    outs = out if isinstance(out, tuple) else (out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs, strict=True):
        if r is None:
            assert o is None
            continue
        assert o.shape == r.shape and o.dtype == r.dtype
        assert (o - r).abs().max().item() <= 1e-12 * max(r.abs().max().item(), 1.0)


# (x shape, normalized_shape, affine)
LAYER_NORMS = [
    ((12, 40), [40], True),
    ((4, 7, 40), [40], True),
    ((4, 7, 40), [7, 40], True),
    ((4, 7, 40), [40], False),
    ((3, 5, 6, 8), [6, 8], True),
    ((9,), [9], False),
]


@pytest.mark.parametrize(("shape", "normalized", "affine"), LAYER_NORMS)
def test_layer_norm_equals_torch_forward_and_backward(shape, normalized, affine):
    x = _randn(*shape, seed=1) * 3 + 0.5
    w = _randn(*normalized, seed=2) if affine else None
    b = _randn(*normalized, seed=3) if affine else None
    args = (x, normalized, w, b, 1e-5)
    assert decompose.applies(aten.native_layer_norm.default, args)
    ref = aten.native_layer_norm.default(*args)
    _assert_close(decompose.layer_norm(PLAIN, *args), ref)
    _, mean, rstd = ref
    go = _randn(*shape, seed=4)
    masks = (
        [[True, True, True], [True, False, False], [False, True, True]] if affine else [[True, False, False]]
    )
    for mask in masks:
        bargs = (go, x, normalized, mean, rstd, w, b, mask)
        assert decompose.applies(aten.native_layer_norm_backward.default, bargs)
        _assert_close(
            decompose.layer_norm_backward(PLAIN, *bargs), aten.native_layer_norm_backward.default(*bargs)
        )


@pytest.mark.parametrize(
    ("shape", "dim"), [((30, 40), -1), ((30, 40), 0), ((2, 3, 5, 16), -1), ((2, 3, 5), 1)]
)
def test_softmax_equals_torch_forward_and_backward(shape, dim):
    x = _randn(*shape, seed=5) * 4
    x.view(-1)[::7] = float("-inf")  # masked scores, as causal attention has
    assert decompose.formula_applies(aten._softmax.default, (x, dim, False))
    assert not decompose.applies(aten._softmax.default, (x, dim, False))  # the profiles' formula only
    y = aten._softmax.default(x, dim, False)
    _assert_close(decompose.softmax(PLAIN, x, dim, False), y)
    g = _randn(*shape, seed=6)
    args = (g, y, dim, torch.float64)
    assert decompose.applies(aten._softmax_backward_data.default, args)
    _assert_close(decompose.softmax_backward(PLAIN, *args), aten._softmax_backward_data.default(*args))


def test_applies_only_where_the_decomposition_is_torch():
    x, w = _randn(4, 8, seed=7), _randn(8, seed=8)
    _, mean, rstd = aten.native_layer_norm.default(x, [8], w, w, 1e-5)
    ln, lnb = aten.native_layer_norm.default, aten.native_layer_norm_backward.default
    sm, smb = aten._softmax.default, aten._softmax_backward_data.default
    refused = [
        (ln, (x[:0], [8], w, w, 1e-5)),  # empty
        (ln, (x, [8], w.float(), w, 1e-5)),  # mixed dtypes
        (ln, (x.long(), [8], None, None, 1e-5)),  # not floating
        (ln, (x, [4], None, None, 1e-5)),  # not the trailing dims: torch raises its own error
        (lnb, (x, x, [8], mean, rstd, None, w, [True, True, True])),  # weight gradient of no weight
        (lnb, (x, x, [8], mean, rstd, w, w, [True, True, True], 1)),  # unknown extra argument
        (sm, (x, 1, True)),  # half_to_float
        (sm, (torch.tensor(1.0, dtype=torch.float64), 0, False)),  # 0-dim
        (sm, (x[:0], 1, False)),
        (smb, (x, x, 1, torch.float32)),  # input dtype differs
        (smb, (x.float(), x, 1, torch.float64)),
    ]
    for func, args in refused:
        assert not decompose.formula_applies(func, args), (func, args)
    assert decompose.applies(ln, (x.float(), [8], None, None, 1e-5))  # fp32: one dtype throughout
    assert decompose.applies(lnb, (x, x, [8], mean, rstd, None, None, [True, False, False]))


class LNAttention(nn.Module):
    """Embedding, a softmax over causal scores and two layer norms: tokens ``(N, T)`` -> logits ``(N, T, V)``."""

    def __init__(self, vocab: int = 16, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d, elementwise_affine=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.ln1(self.emb(tokens))
        t = tokens.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        att = (x @ x.transpose(1, 2) / 8).masked_fill(~causal, float("-inf")).softmax(-1)
        return self.head(self.ln2(x + att @ x))


def _record_step(profile: str) -> tuple[StepRounding, nn.Module]:
    """One verifiable forward and backward of :class:`LNAttention` under ``profile`` (tau 2**-8: a log)."""
    torch.manual_seed(0)
    model = LNAttention().double()
    for p in model.parameters():
        p.data = p.data.float().double()
    tokens = torch.randint(0, 16, (8, 12))
    step = StepRounding()
    mode = RoundingMode(get_profile(profile, seed=0), Thresholds(default=2.0**-8))
    with mode.step_scope(step):
        logits = model(tokens)
        F.cross_entropy(logits.reshape(-1, 16), tokens.reshape(-1)).backward()
    return step, model


def test_decomposed_ops_log_only_their_sums_and_exponentials():
    """In verifiable precision no layer norm op or softmax backward reaches the log: their epilogues are
    exact; their sums (logged as ``sum``) are the only machine-dependent steps. Softmax forward stays one
    elementwise op (see ``decompose.softmax``)."""
    step, model = _record_step("native")
    names = set(step.op_names)
    assert not names & {"native_layer_norm", "native_layer_norm_backward", "_softmax_backward_data"}
    assert {"sum", "exp", "_softmax"} <= names
    logged = {step.op_names[e.op] for e in step.recorded if len(e.indices) or len(e.pinned_indices)}
    assert logged, "tau 2**-8 logs something"
    others = {"mm", "bmm", "addmm", "embedding_dense_backward", "_log_softmax", "_softmax"}
    assert logged <= {"sum", "exp"} | others, logged
    for p in model.parameters():
        assert torch.equal(p.grad.float().double(), p.grad)


def test_row_sums_are_marked_for_the_profiles():
    """The sums of the row decompositions run with :func:`decompose.summing_rows` set, so an emulated profile
    orders them as a row kernel (short chunks): rows of 32 are then reordered by every profile, as the
    hardware's own layer norm does, where a plain sum of 32 terms is too short to split."""
    marked: list[bool] = []

    def spy(t: torch.Tensor, dims: list[int]) -> torch.Tensor:
        marked.append(decompose.summing_rows())
        return t.sum(dims)

    x = _randn(6, 32, seed=9)
    decompose.layer_norm(decompose.Steps(spy), x, [32], None, None, 1e-5)
    decompose.softmax(decompose.Steps(spy), x, -1, False)
    assert marked == [True, True, True] and not decompose.summing_rows()
    rows = _randn(64, 32, seed=10) * 2**-20 + 1  # terms whose FP64 sum depends on the order
    for name in ("emulated:splitk", "emulated:reversed", "emulated:pairwise", "emulated:atomic"):
        profile = get_profile(name, seed=0)
        plain = profile(aten.sum.dim_IntList, (rows, [1]), {})
        assert torch.equal(plain, rows.sum(1)), name  # a plain sum of 32 terms: not split
        token = decompose._ROW_SUMS.set(True)
        try:
            as_row = profile(aten.sum.dim_IntList, (rows, [1]), {})
        finally:
            decompose._ROW_SUMS.reset(token)
        assert not torch.equal(as_row, rows.sum(1)), name


def test_exact_rows_sum_to_the_same_bits_in_every_order():
    """Rows that :func:`decompose._exact_rows` accepts sum to one FP64 value whatever the order; the test
    refuses rows too wide in range, off the FP32 grid, or holding inf or NaN."""
    gen = torch.Generator().manual_seed(11)
    rows = torch.randn(200, 48, dtype=torch.float64, generator=gen).float().double()
    rows[::5, 0] = 0.0
    exact = decompose._exact_rows(rows)
    assert bool(exact.all())
    for _ in range(20):
        perm = torch.randperm(48, generator=gen)
        shuffled = rows[:, perm]
        sequential = torch.zeros(200, dtype=torch.float64)
        for j in range(48):  # one term at a time: the order most unlike torch's vectorised sum
            sequential += shuffled[:, j]
        assert torch.equal(sequential, rows.sum(-1))
        assert torch.equal(shuffled.reshape(200, 6, 8).sum(-1).sum(-1), rows.sum(-1))
    wide = rows[:4].clone()
    wide[0, 1] = 2.0**-30 * 1.5  # a term 2**-30 below the others: its spacing is too fine
    wide[1, 1] = 0.1  # off the FP32 grid
    wide[2, 1] = float("inf")
    wide[3, 1] = float("nan")
    assert not bool(decompose._exact_rows(wide).any())
    assert not bool(decompose._exact_rows(rows.float()).any())  # float32 accumulates in float32


def test_the_kernel_path_of_exact_rows_finds_what_the_torch_path_finds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A layer norm's exact rows are found by the C kernel (one pass instead of a dozen torch passes); on
    random rows of FP32-grid values spread over up to 60 binades, with zeros, subnormals, infinities, NaN,
    values off the grid, negated views and rows of one value, it gives the torch rule's answer, row for
    row, and both answers occur."""
    if not hasattr(decompose._native, "exact_rows"):
        pytest.skip("the C kernel is not built here")
    gen = torch.Generator().manual_seed(12)
    seen = {True: 0, False: 0}
    for trial in range(400):
        b, n = int(torch.randint(1, 9, (1,), generator=gen)), int(torch.randint(1, 40, (1,), generator=gen))
        binades = torch.randint(-30, 30, (b, n), generator=gen).double() * (trial % 3) / 2
        rows = (torch.randn(b, n, dtype=torch.float64, generator=gen) * 2.0**binades).float().double()
        r = torch.rand(b, n, generator=gen)
        rows[r < 0.15] = 0.0
        if trial % 7 == 0:
            rows[r > 0.97] = float("inf")
        if trial % 11 == 0:
            rows[r > 0.98] = float("nan")
        if trial % 13 == 0:
            rows[r > 0.9] = 0.1  # off the grid
        if trial % 17 == 0:
            rows[r > 0.8] = 2.0**-140  # subnormal in FP32
        if trial % 5 == 0:
            rows = torch._neg_view(rows)
        found = {}
        for fast in (True, False):
            monkeypatch.setattr(decompose, "KERNEL_ROWS", fast)
            found[fast] = decompose._exact_rows(rows)
        assert torch.equal(found[True], found[False]), trial
        for v in found[True].tolist():
            seen[v] += 1
    assert seen[True] > 100 and seen[False] > 100, seen
    # rows whose only nonzero values are infinities, beside rows of zeros and a mixed one
    inf = float("inf")
    rows = torch.tensor(
        [[inf, 0.0, 0.0], [0.0, 0.0, 0.0], [-inf, -inf, 0.0], [inf, 1.0, 0.0]], dtype=torch.float64
    )
    found = {}
    for fast in (True, False):
        monkeypatch.setattr(decompose, "KERNEL_ROWS", fast)
        found[fast] = decompose._exact_rows(rows)
    assert found[True].tolist() == found[False].tolist() == [False, True, False, False]


def test_layer_norm_mean_of_exact_rows_is_not_logged():
    """A layer norm of FP32-grid rows in verifiable precision: its mean's sum is exact everywhere, and the
    logged sum sees only zeros (no entries) even at a threshold that logs many of the variance's."""
    x = _randn(64, 32, seed=12).float().double()
    step = StepRounding()
    mode = RoundingMode(get_profile("native"), Thresholds(default=2.0**-4))
    with mode.step_scope(step):
        out, mean, _ = aten.native_layer_norm.default(x, [32], None, None, 1e-5)
    assert step.op_names == ["sum", "sum"]  # the mean's sum, then the variance's
    counts = {e.op: len(e.indices) + len(e.pinned_indices) for e in step.recorded}
    assert counts.get(0, 0) == 0 and counts.get(1, 0) > 0
    # the exact sum, the mean of it rounded once as an output (as torch's mean output is)
    assert torch.equal(mean.reshape(-1), (x.sum(-1) / 32).float().double())
    assert torch.equal(out, out.float().double())


@pytest.mark.parametrize(
    "n, c, spatial, groups", [(4, 8, (5, 5), 4), (2, 6, (7,), 3), (3, 4, (3, 3), 4), (2, 4, (2, 2, 2), 1)]
)
def test_group_norm_is_written_out_as_torch_computes_it(n: int, c: int, spatial: tuple, groups: int) -> None:
    """Group norm and its backward, written out as row statistics over each sample's groups and channel
    sums (the rounding mode's decomposition): torch's values to FP64 rounding, at ranks 3 to 5, one group or
    a channel a group; a size that does not match, or a missing weight asked for its gradient, is torch's."""
    g = torch.Generator().manual_seed(n * c)
    x = torch.randn(n, c, *spatial, generator=g, dtype=torch.float64) * 3 + 1
    weight, bias = (torch.randn(c, generator=g, dtype=torch.float64) for _ in range(2))
    hxw = math.prod(spatial)
    args = (x, weight, bias, n, c, hxw, groups, 1e-5)
    plain = decompose.Steps(lambda t, dims: t.sum(dims))
    assert decompose.applies(aten.native_group_norm.default, args)
    want = aten.native_group_norm.default(*args)
    for got, ref in zip(decompose.group_norm(plain, *args), want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    grad = torch.randn(x.shape, generator=g, dtype=torch.float64)
    back = (grad, x, want[1], want[2], weight, n, c, hxw, groups, [True, True, True])
    assert decompose.applies(aten.native_group_norm_backward.default, back)
    for got, ref in zip(
        decompose.group_norm_backward(plain, *back),
        aten.native_group_norm_backward.default(*back),
        strict=True,
    ):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    assert not decompose.applies(
        aten.native_group_norm.default, (x, weight, bias, n, c + 1, hxw, groups, 1e-5)
    )
    assert not decompose.applies(aten.native_group_norm_backward.default, (*back[:4], None, *back[5:]))
