"""Privatizers: streaming Gaussian noise for the sum of clipped updates (docs/explanation/mechanism.md, Noise).

Independent noise is the identity-strategy case. For a strategy C (lower-triangular, largest column norm 1),
the noise of round t is

    w_t = σ·ζ·sens·[C⁻¹ Z]_t ,   Z rows i.i.d. N(0, I_d),   sens = 1 (one participation)

computed online, never as a T×T or T×d matrix:

* **BandMF** (b-banded, column-normalized C; seed 000 §2.1, §4.5; Choquette-Choo et al. 2023): forward
  substitution over the last b−1 outputs, y_t = ( z_t − Σ_{r=1}^{b−1} C[t, t−r] · y_{t−r} ) / C[t, t]. One step is
  one matrix-vector product of the preallocated (b−1)×d ring buffer with the (b−1)-vector of coefficients, subtracted
  from z_t (no loop over bands or parameters), and one copy into the ring: memory (b−1)·d for the ring plus the
  d-vector z_t = y_t that is returned, b·d float64 numbers in all (float64, so that the noise released is C⁻¹Z to
  float64 rounding: docs/explanation/floating-point.md). The step reads the whole ring once, so its time is bounded
  below by the memory bandwidth (``fed-dp benchmark --only noise`` prints that floor).
* **BLT** (``fed_dp.blt``): C = C̃/n_0 with C̃ Toeplitz, c_0 = 1, c_t = Σ_j θ_j ω_j^{t−1}; y = n_0·C̃⁻¹z from ℓ
  buffers S_j: ỹ_t = z_t − Σ_j θ_j S_j(t), then S_j(t+1) = ω_j S_j(t) + ỹ_t. One step is one matrix-vector product
  (the ℓ×d buffers × ℓ coefficients) and one in-place ``addcmul`` updating all buffers: memory ℓ·d plus the
  returned d-vector, (ℓ + 1)·d float64 numbers.

The per-coordinate noise variance of round t on the sum is (σζ)²·‖row t of C⁻¹‖², which DP-AdamBC needs
(docs/explanation/server-optimizers.md). Multiple participations are accounted in the dp_accounting event (σ/√k for BandMF,
σ/sens_t for BLT, or amplification); the noise is always calibrated to a single participation, never
scaled by √k or sens_t here.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from fed_dp.blt import BLTStrategy, config_strategy
from fed_dp.config import PrivacyConfig
from fed_dp.factorization import BandedStrategy, optimize_toeplitz
from fed_dp.randomness import add_on_grid, grid_step, make_noise_source
from fed_dp.validation import check_int

Strategy = BandedStrategy | BLTStrategy

#: Layout of the saved stream state; version 1 (no key) held unit-scale BandMF rings too, so it loads as is.
_STATE_VERSION = 2


def strategy_fingerprint(strategy: Strategy | None) -> str:
    """SHA-256 of the strategy's coefficients ("identity" for independent noise)."""
    if strategy is None:
        return "identity"
    if isinstance(strategy, BLTStrategy):
        data = repr((strategy.rounds, [v.hex() for v in strategy.theta], [v.hex() for v in strategy.omega])).encode()
        return "blt:" + hashlib.sha256(data).hexdigest()
    data = strategy.band.detach().cpu().contiguous().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


class _BandedStream:
    """BandMF's forward substitution over a (b−1)×d ring buffer: slot s holds y_{t'} for t' ≡ s mod (b − 1). The ring and
    the coefficients are float64: with float32 ones the noise released differed from C⁻¹Z by roundings that grow like
    √d (3.5·10⁻⁵ of z per step at d = 10⁶), which neighbouring datasets do not share."""

    def __init__(self, strategy: BandedStrategy, dim: int, device: torch.device) -> None:
        self.band = strategy.band.to(device, torch.float64)  # step t reads row t: C[t, t − r] = band[t, r]
        self._diagonal = strategy.band[:, 0].double().tolist()  # C[t, t] as Python floats (no device sync per step)
        self.lags = strategy.bands - 1
        self.buffer = torch.zeros(self.lags, dim, device=device, dtype=torch.float64)
        self._lag_steps = torch.arange(1, strategy.bands, device=device)
        self._weights = torch.zeros(self.lags, device=device, dtype=torch.float64)
        self.output_scale = 1.0

    def step(self, t: int, z: torch.Tensor) -> torch.Tensor:
        """z ← y_t = (z_t − Σ_r C[t, t−r]·y_{t−r}) / C[t, t], in place, in float64; y_t enters the ring."""
        if self.lags == 0:
            return z.div_(self._diagonal[t])
        # band[t, r] is 0 where t − r < 0, so the zero-initialized ring needs no masking.
        self._weights[(t - self._lag_steps) % self.lags] = self.band[t, 1:]
        z.sub_(torch.mv(self.buffer.t(), self._weights)).mul_(1.0 / self._diagonal[t])
        self.buffer[t % self.lags].copy_(z)
        return z


class _BLTStream:
    """A BLT's ℓ buffers S_j (ℓ×d, float64 as BandMF's ring): ỹ_t = z_t − Σ_j θ_j S_j, then S_j ← ω_j S_j + ỹ_t."""

    def __init__(self, strategy: BLTStrategy, dim: int, device: torch.device) -> None:
        self.theta = torch.tensor(strategy.theta, device=device, dtype=torch.float64)
        self.omega = torch.tensor(strategy.omega, device=device, dtype=torch.float64)[:, None]
        self.buffer = torch.zeros(strategy.buffers, dim, device=device, dtype=torch.float64)
        self.output_scale = strategy.scale  # C⁻¹ = n_0·C̃⁻¹

    def step(self, t: int, z: torch.Tensor) -> torch.Tensor:
        """z ← ỹ_t = z_t − Σ_j θ_j S_j in place, then S_j ← ω_j S_j + ỹ_t, all in float64."""
        z.sub_(torch.mv(self.buffer.t(), self.theta))
        torch.addcmul(z.expand_as(self.buffer), self.omega, self.buffer, out=self.buffer)
        return z


class Privatizer:
    """Adds σζ·[C⁻¹Z]_t to the t-th sum of clipped user updates; a stream with checkpointable state.

    Args:
        strategy: the BandMF or BLT strategy C, or ``None`` for independent Gaussian noise (C = I, no horizon).
        noise_std: σ·ζ, the noise std on the sum for one participation (times the row norm of C⁻¹).
        dim: d, the length of the flat update vector.
        seed: generator seed of the ``"torch"`` source; ``None`` draws one from OS entropy
            (``seeded_explicitly`` tells which).
        device, dtype: where the noise and the buffers live, and the dtype of the released sums (the noise and the
            buffers are float64).
        source: where Z comes from (``fed_dp.randomness``): ``"torch"`` (a seeded ``torch.Generator``) or
            ``"secure"`` (AES-256-CTR keyed from OS entropy; takes no seed).

    State: ``index`` (the next step t), the buffers (BandMF: the last b−1 unit-scale outputs; BLT: the ℓ
    unit-scale S_j) and the noise source's state. ``state_dict``/``load_state_dict`` restore them exactly,
    so a resumed run continues the same noise stream and never reuses a noise vector. The state is a secret
    of the server: whoever holds it can subtract the noise.
    """

    def __init__(
        self,
        strategy: Strategy | None,
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
        dim = check_int("dim", dim, minimum=1)
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be floating point, got {dtype}")
        if strategy is not None and not isinstance(strategy, (BandedStrategy, BLTStrategy)):
            raise ValueError(f"strategy must be a BandedStrategy, a BLTStrategy or None, got {type(strategy).__name__}")
        self.strategy = strategy
        self.noise_std = float(noise_std)
        self.dim = dim
        self.device = torch.device(device)
        self.dtype = dtype
        self._source = make_noise_source(source, seed, self.device)
        self.seeded_explicitly = seed is not None
        self.index = 0
        if strategy is None:
            self._stream = None
        elif isinstance(strategy, BLTStrategy):
            self._stream = _BLTStream(strategy, dim, self.device)
        else:
            self._stream = _BandedStream(strategy, dim, self.device)

    @property
    def seed(self) -> int | None:
        """The seed of a ``"torch"`` noise source (None for the secure source, which has a key instead)."""
        return getattr(self._source, "seed", None)

    @property
    def bands(self) -> int:
        """b of a BandMF strategy (1 for independent noise and for BLT, which is not banded)."""
        return self.strategy.bands if isinstance(self.strategy, BandedStrategy) else 1

    @property
    def buffer(self) -> torch.Tensor | None:
        """The stream's buffers (BandMF: (b−1)×d ring; BLT: ℓ×d); ``None`` for independent noise."""
        return None if self._stream is None else self._stream.buffer

    @property
    def horizon(self) -> int | None:
        """The number of steps the strategy was built for (``None``: unbounded, independent noise)."""
        return None if self.strategy is None else self.strategy.rounds

    def _check_step(self, t: int) -> None:
        if self.horizon is not None and t >= self.horizon:
            raise ValueError(
                f"the correlated-noise strategy was built for T = {self.horizon} rounds; step {t} is past it. "
                "Build the strategy for the full number of rounds"
            )

    def _draw(self, std: float) -> torch.Tensor:
        """w_t = std·[C⁻¹Z]_t for the current t, a fresh float64 d-vector (z_t drawn in float64, the recursion of a
        correlated stream computed in float64 against its buffers); updates the buffers and advances the index."""
        t = self.index
        self._check_step(t)
        z = self._source.normal(self.dim, torch.float64)
        if self._stream is None:
            noise = z.mul_(std)
        else:
            noise = self._stream.step(t, z).mul_(std * self._stream.output_scale)
        self.index = t + 1
        return noise

    def _std(self, noise_std: float | None) -> float:
        if noise_std is None:
            return self.noise_std
        if self.strategy is not None:
            raise ValueError(
                "correlated (BandMF, BLT) noise needs the same scale every round (its correlations cancel only then); "
                "a per-round noise std (adaptive clipping) is allowed for independent noise only"
            )
        if not (isinstance(noise_std, (int, float)) and noise_std > 0 and noise_std != float("inf")):
            raise ValueError(f"noise_std must be a finite number > 0, got {noise_std!r}")
        return float(noise_std)

    def next_noise(self, noise_std: float | None = None) -> torch.Tensor:
        """w_t = σζ·[C⁻¹Z]_t, a fresh float64 d-vector; advances the stream by one step. For measurements and tests:
        a release is :meth:`privatize` (never add this to a sum in float32 yourself: see there).

        ``noise_std`` overrides σζ for this step (independent noise only: adaptive clipping changes ζ_t
        and σ_Δ every round).
        """
        return self._draw(self._std(noise_std))

    def privatize(self, total: torch.Tensor, noise_std: float | None = None) -> torch.Tensor:
        """Σ_t + w_t for the sum of clipped updates ``total`` (a new tensor of the privatizer's dtype; ``total`` is
        untouched), formed on the grid Λ = 2^(⌊log₂(σζ)⌋ − 36): Λ·(round(Σ_t/Λ) + round(w_t/Λ)), exact in float64,
        then rounded once (``fed_dp.randomness.add_on_grid``). Adding a float32 noise vector to the sum would leave
        outputs that only one of two neighbouring sums can produce (docs/explanation/floating-point.md)."""
        if total.shape != (self.dim,):
            raise ValueError(f"sum of updates has shape {tuple(total.shape)}, expected ({self.dim},)")
        std = self._std(noise_std)
        release = add_on_grid(total, self._draw(std), grid_step(std), self.dtype)
        self._source.prefetch(self.dim)  # the secure source makes the next round's keystream while users train
        return release

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
        buffer = self.buffer if self.buffer is not None else torch.zeros(0, self.dim, dtype=self.dtype)
        return {
            "version": _STATE_VERSION,
            "strategy": strategy_fingerprint(self.strategy),
            "noise_std": self.noise_std,
            "dim": self.dim,
            "seeded_explicitly": self.seeded_explicitly,
            "index": self.index,
            "buffer": buffer.detach().cpu().clone(),
            "source": self._source.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved stream; refuses a state of another strategy, scale, dimension or layout version.

        States without a version (written before version 2) hold the same unit-scale BandMF ring, so
        they load unchanged.
        """
        version = state.get("version", 1)
        if version not in (1, _STATE_VERSION):
            raise ValueError(f"privatizer state has version {version!r}; this fed-dp reads versions 1 and {_STATE_VERSION}")
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
        expected = (0, self.dim) if self._stream is None else tuple(self._stream.buffer.shape)
        if tuple(buffer.shape) != expected:
            raise ValueError(f"privatizer buffer has shape {tuple(buffer.shape)}, expected {expected}")
        self.seeded_explicitly = bool(state["seeded_explicitly"])
        self.index = int(state["index"])
        if self._stream is not None:  # a float32 buffer of an earlier fed-dp loads as float64
            self._stream.buffer.copy_(buffer.to(self.device, torch.float64))
        self._source.load_state_dict(state["source"])


def make_strategy(config: PrivacyConfig, cache_dir: str | None = None) -> Strategy | None:
    """The strategy C of ``config``: ``None`` (identity) for independent noise, the optimized banded
    Toeplitz strategy for (T, b, workload) for BandMF, the optimized BLT for (T, buffers, min-separation,
    workload) for BLT (``fed_dp.blt.config_strategy``, the one the accounting uses); read from the on-disk
    cache when present."""
    if config.noise == "independent":
        return None
    if config.noise == "blt":
        return config_strategy(config, cache_dir=cache_dir)
    return optimize_toeplitz(config.rounds, config.bands, momentum=config.workload_momentum, cache_dir=cache_dir)


class NoNoise:
    """The privatizer of the explicit non-private baseline (``noise_multiplier = 0``): w_t = 0, and no noise is
    drawn at all (no source, no seed). Only :func:`make_privatizer` builds it, and only for a config whose
    ``non_private`` is true, so a σ of 0 can never reach a run by accident; ε is then infinite and every output
    says so (``fed_dp.context.reported_epsilon``). Same interface as :class:`Privatizer` for the round."""

    strategy = None
    noise_std = 0.0
    seeded_explicitly = False
    buffer = None
    horizon = None

    def __init__(self, dim: int, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> None:
        dim = check_int("dim", dim, minimum=1)
        self.dim, self.device, self.dtype = dim, torch.device(device), dtype
        self.index = 0

    def next_noise(self, noise_std: float | None = None) -> torch.Tensor:
        """w_t = 0 (a d-vector of zeros); advances the step."""
        self.index += 1
        return torch.zeros(self.dim, device=self.device, dtype=self.dtype)

    def privatize(self, total: torch.Tensor, noise_std: float | None = None) -> torch.Tensor:
        """Σ_t itself (a new tensor): nothing is added."""
        if total.shape != (self.dim,):
            raise ValueError(f"sum of updates has shape {tuple(total.shape)}, expected ({self.dim},)")
        self.index += 1
        return total.to(self.device, self.dtype).clone()

    def noise_variance(self, t: int | None = None) -> float:
        return 0.0

    def state_dict(self) -> dict[str, Any]:
        return {"version": _STATE_VERSION, "strategy": "none (non-private: noise_multiplier = 0)", "noise_std": 0.0,
                "dim": self.dim, "index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("noise_std") != 0.0 or state.get("dim") != self.dim:
            raise ValueError("this privatizer state is not that of a non-private run of the same dimension; "
                             "a noise stream can only be resumed by the same mechanism")
        self.index = int(state["index"])


def make_privatizer(
    config: PrivacyConfig,
    dim: int,
    *,
    seed: int | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    strategy: Strategy | None = None,
    source: str = "torch",
) -> Privatizer | NoNoise:
    """The privatizer of ``config`` with noise std σζ (:class:`NoNoise` for ``noise_multiplier = 0``) on the sum (strategy built if not given); ``source``:
    the noise source (``fed_dp.randomness``).

    A given BandMF strategy must match the config's T and b (any column-normalized b-banded C has the
    accounted sensitivity). A given BLT strategy must be the config's own (``make_strategy``): the
    accounting uses that strategy's sensitivity, so noise from another BLT would not be the ε reported.
    """
    config.require_resolved("the privatizer")
    if config.non_private:  # the explicit non-private baseline: no noise drawn at all
        return NoNoise(dim, device=device, dtype=dtype)
    if strategy is None:
        strategy = make_strategy(config)
    elif config.noise == "independent":
        raise ValueError("a strategy was given but config.noise is 'independent'")
    elif config.noise == "blt":
        if strategy != make_strategy(config):
            raise ValueError(
                "a BLT strategy was given that is not the config's optimized BLT; the accounting uses the "
                "sensitivity of the config's strategy, so leave strategy unset (make_strategy(config) builds it)"
            )
    elif not isinstance(strategy, BandedStrategy) or strategy.rounds != config.rounds or strategy.bands != config.bands:
        raise ValueError(
            f"strategy must be a BandedStrategy for T = {config.rounds}, b = {config.bands} (noise 'bandmf'); "
            f"got {type(strategy).__name__} for T = {strategy.rounds}"
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
