"""Privatizers: streaming Gaussian noise for the sum of clipped updates (ALGORITHMS §2).

Independent noise is the identity-strategy case of BandMF. For a b-banded, lower-triangular,
column-normalized C (seed 000 §2.1, §4.5; Choquette-Choo et al. 2023), the noise of round t is

    w_t = σ·ζ·sens·[C⁻¹ Z]_t ,   Z rows i.i.d. N(0, I_d),   sens = 1 (one participation)

computed online by forward substitution, keeping only the last b−1 outputs:

    y_t = ( z_t − Σ_{r=1}^{b−1} C[t, t−r] · y_{t−r} ) / C[t, t]

Each step is one batched tensor operation over the (b−1)×d ring buffer (a matrix-vector product),
never a loop over bands or parameters. The per-coordinate noise variance of round t on the sum is
(σζ)²·‖row t of C⁻¹‖², which DP-AdamBC needs (ALGORITHMS §3.3).

Multiple participations are accounted in the dp_accounting event (σ/√k, or amplification); the noise is
always calibrated to a single participation, never scaled by √k here.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from fed_dp.config import PrivacyConfig
from fed_dp.factorization import BandedStrategy, optimize_toeplitz
from fed_dp.randomness import make_noise_source


def strategy_fingerprint(strategy: BandedStrategy | None) -> str:
    """SHA-256 of the strategy's band coefficients ("identity" for independent noise)."""
    if strategy is None:
        return "identity"
    data = strategy.band.detach().cpu().contiguous().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


class Privatizer:
    """Adds σζ·[C⁻¹Z]_t to the t-th sum of clipped user updates; a stream with checkpointable state.

    Args:
        strategy: the BandMF strategy C, or ``None`` for independent Gaussian noise (C = I, no horizon).
        noise_std: σ·ζ, the noise std on the sum for one participation (times the row norm of C⁻¹).
        dim: d, the length of the flat update vector.
        seed: generator seed of the ``"torch"`` source; ``None`` draws one from OS entropy
            (``seeded_explicitly`` tells which).
        device, dtype: where and in which precision the noise and the buffer live.
        source: where Z comes from (``fed_dp.randomness``): ``"torch"`` (a seeded ``torch.Generator``) or
            ``"secure"`` (AES-256-CTR keyed from OS entropy; takes no seed).

    State: ``index`` (the next step t), the ring buffer of the last b−1 unit-scale outputs, and the
    noise source's state. ``state_dict``/``load_state_dict`` restore them exactly, so a resumed run
    continues the same noise stream and never reuses a noise vector. The state is a secret of the server:
    whoever holds it can subtract the noise.
    """

    def __init__(
        self,
        strategy: BandedStrategy | None,
        *,
        noise_std: float,
        dim: int,
        seed: int | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        source: str = "torch",
    ) -> None:
        if not (isinstance(noise_std, (int, float)) and noise_std > 0 and noise_std != float("inf")):
            raise ValueError(f"noise_std (σ·ζ) must be a finite number > 0, got {noise_std!r}")
        if not (isinstance(dim, int) and dim >= 1):
            raise ValueError(f"dim must be an integer >= 1, got {dim!r}")
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be floating point, got {dtype}")
        self.strategy = strategy
        self.noise_std = float(noise_std)
        self.dim = dim
        self.device = torch.device(device)
        self.dtype = dtype
        self._source = make_noise_source(source, seed, self.device)
        self.seeded_explicitly = seed is not None
        self.index = 0
        bands = 1 if strategy is None else strategy.bands
        self._buffer = torch.zeros(bands - 1, dim, device=self.device, dtype=dtype)
        # Coefficients on the device once; step t reads its row.
        self._band = None if strategy is None else strategy.band.to(self.device, dtype)

    @property
    def seed(self) -> int | None:
        """The seed of a ``"torch"`` noise source (None for the secure source, which has a key instead)."""
        return getattr(self._source, "seed", None)

    @property
    def bands(self) -> int:
        return 1 if self.strategy is None else self.strategy.bands

    @property
    def horizon(self) -> int | None:
        """The number of steps the strategy was built for (``None``: unbounded, independent noise)."""
        return None if self.strategy is None else self.strategy.rounds

    def _check_step(self, t: int) -> None:
        if self.horizon is not None and t >= self.horizon:
            raise ValueError(
                f"the BandMF strategy was built for T = {self.horizon} rounds; step {t} is past it. "
                "Build the strategy for the full number of rounds"
            )

    def _unit_noise(self) -> torch.Tensor:
        """y_t = [C⁻¹Z]_t for the current t, updating the ring buffer; advances the index."""
        t = self.index
        self._check_step(t)
        z = self._source.normal(self.dim, self.dtype)
        if self._band is None:
            y = z
        else:
            b = self.bands
            if b > 1:
                lags = torch.arange(1, b, device=self.device)
                slots = (t - lags) % (b - 1)  # ring slot holding y_{t−r}
                weights = torch.zeros(b - 1, device=self.device, dtype=self.dtype)
                # band[t, r] is 0 where t − r < 0, so the zero-initialized buffer needs no masking.
                weights[slots] = self._band[t, 1:]
                y = (z - weights @ self._buffer) / self._band[t, 0]
                self._buffer[t % (b - 1)] = y
            else:
                y = z / self._band[t, 0]
        self.index = t + 1
        return y

    def _std(self, noise_std: float | None) -> float:
        if noise_std is None:
            return self.noise_std
        if self.strategy is not None:
            raise ValueError(
                "BandMF noise needs the same scale every round (its correlations cancel only then); "
                "a per-round noise std (adaptive clipping) is allowed for independent noise only"
            )
        if not (isinstance(noise_std, (int, float)) and noise_std > 0 and noise_std != float("inf")):
            raise ValueError(f"noise_std must be a finite number > 0, got {noise_std!r}")
        return float(noise_std)

    def next_noise(self, noise_std: float | None = None) -> torch.Tensor:
        """w_t = σζ·[C⁻¹Z]_t, a fresh d-vector; advances the stream by one step.

        ``noise_std`` overrides σζ for this step (independent noise only: adaptive clipping changes ζ_t
        and σ_Δ every round).
        """
        std = self._std(noise_std)
        return std * self._unit_noise()

    def privatize(self, total: torch.Tensor, noise_std: float | None = None) -> torch.Tensor:
        """Σ_t + w_t for the sum of clipped updates ``total`` (a new tensor; ``total`` is untouched)."""
        if total.shape != (self.dim,):
            raise ValueError(f"sum of updates has shape {tuple(total.shape)}, expected ({self.dim},)")
        return total.to(self.device, self.dtype) + self.next_noise(noise_std)

    def noise_variance(self, t: int | None = None) -> float:
        """Per-coordinate variance of w_t on the sum: (σζ)²·‖row t of C⁻¹‖² (default t: the last step)."""
        t = self.index - 1 if t is None else t
        if t < 0:
            raise ValueError("no noise step has been taken yet; pass t explicitly")
        self._check_step(t)
        if self.strategy is None:
            return self.noise_std**2
        return self.noise_std**2 * float(self.strategy.inverse_row_sq_norms()[t])

    # --- checkpointing -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "strategy": strategy_fingerprint(self.strategy),
            "noise_std": self.noise_std,
            "dim": self.dim,
            "seeded_explicitly": self.seeded_explicitly,
            "index": self.index,
            "buffer": self._buffer.detach().cpu().clone(),
            "source": self._source.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved stream; refuses a state of another strategy, scale or dimension."""
        for key, mine in (
            ("strategy", strategy_fingerprint(self.strategy)),
            ("noise_std", self.noise_std),
            ("dim", self.dim),
        ):
            if state[key] != mine:
                raise ValueError(
                    f"privatizer state has {key} = {state[key]!r}, this privatizer has {mine!r}; "
                    "a noise stream can only be resumed by the same mechanism"
                )
        buffer = state["buffer"]
        if tuple(buffer.shape) != tuple(self._buffer.shape):
            raise ValueError(f"privatizer buffer has shape {tuple(buffer.shape)}, expected {tuple(self._buffer.shape)}")
        self.seeded_explicitly = bool(state["seeded_explicitly"])
        self.index = int(state["index"])
        self._buffer = buffer.to(self.device, self.dtype).clone()
        self._source.load_state_dict(state["source"])


def make_strategy(config: PrivacyConfig, cache_dir: str | None = None) -> BandedStrategy | None:
    """The strategy C of ``config``: ``None`` (identity) for independent noise, else the optimized
    banded Toeplitz strategy for (T, b, workload), read from the on-disk cache when present."""
    if config.noise == "independent":
        return None
    momentum = config.momentum if config.workload == "momentum" else 0.0
    return optimize_toeplitz(config.rounds, config.bands, momentum=momentum, cache_dir=cache_dir)


def make_privatizer(
    config: PrivacyConfig,
    dim: int,
    *,
    seed: int | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    strategy: BandedStrategy | None = None,
    source: str = "torch",
) -> Privatizer:
    """The privatizer of ``config`` with noise std σζ on the sum (strategy built if not given); ``source``:
    the noise source (``fed_dp.randomness``)."""
    config.require_resolved("the privatizer")
    if strategy is None:
        strategy = make_strategy(config)
    elif config.noise == "independent":
        raise ValueError("a strategy was given but config.noise is 'independent'")
    elif strategy.rounds != config.rounds or strategy.bands != config.bands:
        raise ValueError(
            f"strategy is for T = {strategy.rounds}, b = {strategy.bands}; config has "
            f"T = {config.rounds}, b = {config.bands}"
        )
    return Privatizer(
        strategy,
        noise_std=config.noise_multiplier * config.clip_norm,
        dim=dim,
        seed=seed,
        device=device,
        dtype=dtype,
        source=source,
    )
