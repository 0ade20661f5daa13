"""Ops with no FP64 kernel, written as ops that have one (detrl/core/composites.py): the same results as
torch's own kernel where it runs, and recorded and replayed like any other op in verifiable precision."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from detrl.core import composites
from detrl.testing import zoo

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")


def _operands(shape_a: tuple[int, ...], shape_b: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(shape_a, generator=g), torch.randn(shape_b, generator=g)


@pytest.mark.parametrize(
    ("shape_a", "shape_b", "offs"),
    [
        ((10, 4), (3, 4, 8), [3, 6, 8]),  # tokens by expert: rows past offs[-1] are zero
        ((10, 4), (3, 4, 8), [0, 6, 10]),  # an expert with no tokens
        ((8, 12), (12, 8), [3, 6, 12]),  # an expert's weight gradient: K split by offs
        ((3, 8, 4), (3, 4, 8), None),  # batched
    ],
)
def test_grouped_mm_gives_torchs_products_group_by_group(shape_a, shape_b, offs) -> None:
    a, b = _operands(shape_a, shape_b)
    o = None if offs is None else torch.tensor(offs, dtype=torch.int32)
    want = torch._grouped_mm(a, b, offs=o)
    got = composites.grouped_mm(a.double(), b.double(), offs=o)
    assert got.dtype == torch.float64 and got.shape == want.shape
    if len(shape_a) == 2 and len(shape_b) == 3:  # torch leaves the rows past offs[-1] unwritten
        got, want = got[: offs[-1]], want[: offs[-1]]
        assert not composites.grouped_mm(a, b, offs=o)[offs[-1] :].any()
    torch.testing.assert_close(got.float(), want, rtol=1e-5, atol=1e-5)


def test_grouped_mm_of_a_3d_by_a_2d_operand_and_with_a_bias() -> None:
    a, b = _operands((3, 8, 4), (4, 12))
    bias = torch.arange(3 * 5, dtype=torch.float64).reshape(3, 5)
    got = composites.grouped_mm(a.double(), b.double(), offs=torch.tensor([2, 7, 10]))
    for g, (s, e) in enumerate([(0, 2), (2, 7), (7, 10)]):
        assert torch.equal(got[:, s:e], a[g].double() @ b[:, s:e].double())
    assert not got[:, 10:].any()
    a, b = _operands((3, 8, 4), (3, 4, 5))
    with_bias = composites.grouped_mm(a.double(), b.double(), bias=bias)
    assert torch.equal(with_bias, torch.baddbmm(bias.unsqueeze(1), a.double(), b.double()))


def test_grouped_mm_refuses_offsets_outside_its_operand() -> None:
    a, b = _operands((10, 4), (3, 4, 8))
    with pytest.raises(ValueError, match="offs must increase"):
        composites.grouped_mm(a, b, offs=torch.tensor([3, 2, 8]))
    with pytest.raises(ValueError, match="needs offs"):
        composites.grouped_mm(a, b)


class _Experts(torch.nn.Module):
    """Three experts' weights applied to their tokens in one ``F.grouped_mm`` (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.experts = torch.nn.Parameter(torch.randn(3, 8, 8) / 8)
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        offs = torch.tensor([5, 11, 16], dtype=torch.int32)  # 16 rows: 5, 6 and 5 tokens an expert
        return self.head(F.grouped_mm(h, self.experts, offs=offs))


def test_a_grouped_product_records_and_replays_in_verifiable_precision(tmp_path) -> None:
    """torch's kernel has no FP64 form: recording stopped with 'Expected mat_a to be Float32, BFloat16 or
    Float16' at the first MoE layer (Mixtral, Qwen2-MoE). Written out, each expert's product is an op of the
    step, and the run replays on other profiles with nothing unlogged."""
    specimen = zoo.Specimen("experts", _Experts, lambda: zoo.features(zoo.Size(width=16)), zoo.classify)
    rec = zoo.record(specimen, tmp_path / "run", steps=2)
    assert rec.totals.refused == 0
    want = {k: v.detach().clone() for k, v in rec.model.named_parameters()}
    for hw in ("emulated:splitk", "emulated:atomic"):
        rep = zoo.replay(specimen, tmp_path / "run", hw, steps=2)
        assert rep.totals.unlogged_near == 0 and rep.totals.refused == 0, hw
        assert all(torch.equal(v, want[k]) for k, v in rep.model.named_parameters()), hw
