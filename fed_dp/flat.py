"""One flat float32 vector per model update, and the layout to convert back (docs/explanation/architecture.md).

Clipping, noise and optimizers then act on a single tensor: the L2 norm of a user update is the norm of
its flat vector, i.e. over *all* tensors together (docs/explanation/mechanism.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

FLAT_DTYPE = torch.float32


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one tensor of the model."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _torch_dtype(array: np.ndarray | torch.Tensor) -> torch.dtype:
    if isinstance(array, torch.Tensor):
        return array.dtype
    return torch.from_numpy(np.empty(0, dtype=array.dtype)).dtype


@dataclass(frozen=True)
class ParamLayout:
    """The ordered tensors of a model; converts them to one float32 vector and back.

    ``flatten`` concatenates the tensors in layout order (row-major); ``unflatten`` splits a vector back
    into tensors of the original shapes and dtypes. Only floating-point tensors are allowed: integer
    buffers (e.g. BatchNorm's ``num_batches_tracked``) are not trainable and must be left out of the
    update (use ``model.named_parameters()``).
    """

    specs: tuple[TensorSpec, ...]

    def __post_init__(self) -> None:
        names = [s.name for s in self.specs]
        if len(set(names)) != len(names):
            raise ValueError(f"ParamLayout: duplicate tensor names in {names}")
        for spec in self.specs:
            if not spec.dtype.is_floating_point:
                raise ValueError(
                    f"ParamLayout: tensor {spec.name!r} has dtype {spec.dtype}; only floating-point "
                    "tensors can be part of a model update (leave integer buffers out, e.g. use "
                    "model.named_parameters() instead of state_dict())"
                )

    # --- construction ----------------------------------------------------------------------------
    @classmethod
    def from_state_dict(cls, state: Mapping[str, torch.Tensor | np.ndarray]) -> "ParamLayout":
        return cls(
            tuple(TensorSpec(name, tuple(t.shape), _torch_dtype(t)) for name, t in state.items())
        )

    @classmethod
    def from_arrays(
        cls, arrays: Sequence[np.ndarray | torch.Tensor], names: Sequence[str] | None = None
    ) -> "ParamLayout":
        names = [str(i) for i in range(len(arrays))] if names is None else list(names)
        if len(names) != len(arrays):
            raise ValueError(f"ParamLayout: {len(names)} names for {len(arrays)} arrays")
        return cls(
            tuple(TensorSpec(n, tuple(a.shape), _torch_dtype(a)) for n, a in zip(names, arrays))
        )

    # --- properties ------------------------------------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs)

    @property
    def size(self) -> int:
        """d: the number of scalars in the flat vector."""
        return sum(s.numel for s in self.specs)

    # --- conversion ------------------------------------------------------------------------------
    def flatten(
        self, tensors: Mapping[str, torch.Tensor | np.ndarray] | Sequence[torch.Tensor | np.ndarray]
    ) -> torch.Tensor:
        """Concatenate tensors (a mapping by name, or a sequence in layout order) into a float32 vector."""
        if isinstance(tensors, Mapping):
            missing = [n for n in self.names if n not in tensors]
            extra = [n for n in tensors if n not in set(self.names)]
            if missing or extra:
                raise ValueError(f"ParamLayout.flatten: missing tensors {missing}, unexpected {extra}")
            ordered = [tensors[n] for n in self.names]
        else:
            ordered = list(tensors)
            if len(ordered) != len(self.specs):
                raise ValueError(
                    f"ParamLayout.flatten: expected {len(self.specs)} tensors, got {len(ordered)}"
                )
        parts = []
        for spec, tensor in zip(self.specs, ordered):
            t = torch.as_tensor(tensor)
            if tuple(t.shape) != spec.shape:
                raise ValueError(
                    f"ParamLayout.flatten: tensor {spec.name!r} has shape {tuple(t.shape)}, "
                    f"expected {spec.shape}"
                )
            parts.append(t.reshape(-1).to(FLAT_DTYPE))
        if not parts:
            return torch.zeros(0, dtype=FLAT_DTYPE)
        device = parts[0].device
        return torch.cat([p.to(device) for p in parts])

    def _split(self, vector: torch.Tensor) -> list[torch.Tensor]:
        if vector.ndim != 1 or vector.numel() != self.size:
            raise ValueError(
                f"ParamLayout: expected a flat vector of {self.size} values, got shape {tuple(vector.shape)}"
            )
        chunks = torch.split(vector, [s.numel for s in self.specs])
        return [c.reshape(s.shape).to(s.dtype) for c, s in zip(chunks, self.specs)]

    def unflatten(self, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        """Split a flat vector back into ``{name: tensor}`` with the layout's shapes and dtypes."""
        return dict(zip(self.names, self._split(vector)))

    def to_arrays(self, vector: torch.Tensor) -> list[np.ndarray]:
        """Split a flat vector into numpy arrays in layout order (the form Flower's ArrayRecord takes)."""
        return [t.detach().cpu().numpy() for t in self._split(vector)]
