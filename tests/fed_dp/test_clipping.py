"""Clipping: the bound holds over the whole update, directions are kept, bad input is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fed_dp.clipping import clip_rows, clip_scaled, clip_update
from fed_dp.flat import ParamLayout


def _reference_clip(u: np.ndarray, clip_norm: float) -> np.ndarray:
    """u·min(1, ζ/‖u‖) in float64 numpy, independent of the code under test."""
    norm = np.sqrt(np.sum(u.astype(np.float64) ** 2))
    return u * min(1.0, clip_norm / norm) if norm > 0 else u


@pytest.mark.parametrize("scale", [0.01, 1.0, 100.0, 1e6])
def test_clip_matches_the_formula_and_bounds_the_norm(scale):
    g = torch.Generator().manual_seed(0)
    update = scale * torch.randn(1000, generator=g, dtype=torch.float64)
    result = clip_update(update, 2.5)
    np.testing.assert_allclose(result.update.numpy(), _reference_clip(update.numpy(), 2.5), rtol=1e-12)
    assert result.update.norm().item() <= 2.5 * (1 + 1e-12)
    assert result.norm == pytest.approx(update.norm().item())
    assert result.clipped == (update.norm().item() > 2.5)


def test_clip_below_the_bound_is_the_identity():
    update = torch.tensor([0.3, -0.4])  # norm 0.5
    result = clip_update(update, 1.0)
    assert torch.equal(result.update, update) and not result.clipped


def test_clip_of_zero_is_zero():
    assert torch.equal(clip_update(torch.zeros(5), 1.0).update, torch.zeros(5))


def test_clip_is_over_all_tensors_together():
    """Two tensors each within ζ but jointly above: the flat clip scales both."""
    state = {"w": torch.full((2, 2), 0.4), "b": torch.full((3,), 0.5)}  # norms 0.8 and 0.866
    layout = ParamLayout.from_state_dict(state)
    clipped = layout.unflatten(clip_update(layout.flatten(state), 1.0).update)
    joint = torch.sqrt(sum(t.square().sum() for t in clipped.values()))
    assert joint.item() == pytest.approx(1.0, rel=1e-6)
    assert clipped["w"][0, 0].item() < 0.4  # per-tensor clipping would have left w alone


def test_clip_rows_equals_clipping_each_row():
    g = torch.Generator().manual_seed(1)
    updates = torch.randn(7, 50, generator=g) * torch.tensor([0.01, 0.1, 1, 3, 10, 0, 1e4]).unsqueeze(1)
    clipped, norms = clip_rows(updates, 1.5)
    for i in range(7):
        single = clip_update(updates[i], 1.5)
        torch.testing.assert_close(clipped[i], single.update)
        assert norms[i].item() == pytest.approx(single.norm, rel=1e-6)


def test_clip_scaled_clips_in_the_scaled_geometry():
    g = torch.Generator().manual_seed(2)
    delta = torch.randn(100, generator=g, dtype=torch.float64)
    scale = torch.rand(100, generator=g, dtype=torch.float64) * 10 + 0.1
    result = clip_scaled(delta, scale, 1.0)
    np.testing.assert_allclose(result.update.numpy(), _reference_clip((scale * delta).numpy(), 1.0), rtol=1e-12)
    assert result.norm == pytest.approx((scale * delta).norm().item())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_updates_are_refused(bad):
    update = torch.ones(4)
    update[2] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        clip_update(update, 1.0)
    with pytest.raises(ValueError, match="NaN or Inf"):
        clip_rows(update.reshape(2, 2), 1.0)


@pytest.mark.parametrize("clip_norm", [0.0, -1.0, float("inf"), float("nan")])
def test_invalid_clip_norm_is_refused(clip_norm):
    with pytest.raises(ValueError, match="clip_norm"):
        clip_update(torch.ones(3), clip_norm)


def test_invalid_shapes_and_scales_are_refused():
    with pytest.raises(ValueError, match="flat 1-D"):
        clip_update(torch.ones(2, 2), 1.0)
    with pytest.raises(ValueError, match="matrix"):
        clip_rows(torch.ones(3), 1.0)
    with pytest.raises(ValueError, match="positive"):
        clip_scaled(torch.ones(3), torch.tensor([1.0, 0.0, 1.0]), 1.0)
    with pytest.raises(ValueError, match="shape"):
        clip_scaled(torch.ones(3), torch.ones(4), 1.0)
