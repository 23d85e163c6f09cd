"""ParamLayout: state_dict / list of arrays ⇄ one float32 vector, exactly and with clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fed_dp.flat import ParamLayout


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))


def test_state_dict_round_trip():
    state = {k: v.detach().clone() for k, v in _model().named_parameters()}
    layout = ParamLayout.from_state_dict(state)
    vector = layout.flatten(state)
    assert vector.dtype == torch.float32 and vector.shape == (layout.size,)
    assert layout.size == sum(v.numel() for v in state.values())
    restored = layout.unflatten(vector)
    assert list(restored) == list(state)
    for name, tensor in state.items():
        assert torch.equal(restored[name], tensor)


def test_flatten_order_is_layout_order_row_major():
    state = {"a": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "b": torch.tensor([5.0])}
    layout = ParamLayout.from_state_dict(state)
    assert layout.flatten({"b": state["b"], "a": state["a"]}).tolist() == [1, 2, 3, 4, 5]


def test_arrays_round_trip_keeps_dtypes():
    arrays = [np.arange(6, dtype=np.float64).reshape(2, 3) / 7, np.ones(4, dtype=np.float16)]
    layout = ParamLayout.from_arrays(arrays)
    back = layout.to_arrays(layout.flatten(arrays))
    assert [a.dtype for a in back] == [np.float64, np.float16]
    np.testing.assert_allclose(back[0], arrays[0].astype(np.float32), rtol=0)
    np.testing.assert_array_equal(back[1], arrays[1])


def test_mismatches_are_clear_errors():
    layout = ParamLayout.from_state_dict({"w": torch.zeros(2, 3), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"'w' has shape \(3, 2\)"):
        layout.flatten({"w": torch.zeros(3, 2), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match="missing tensors"):
        layout.flatten({"w": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match="expected 2 tensors"):
        layout.flatten([torch.zeros(2, 3)])
    with pytest.raises(ValueError, match="flat vector of 9"):
        layout.unflatten(torch.zeros(10))


def test_integer_buffers_are_refused_with_advice():
    with pytest.raises(ValueError, match="named_parameters"):
        ParamLayout.from_state_dict({"num_batches_tracked": torch.tensor(3)})


def test_duplicate_names_are_refused():
    with pytest.raises(ValueError, match="duplicate"):
        ParamLayout.from_arrays([np.zeros(1), np.zeros(1)], names=["x", "x"])
