"""Where the randomness of a run comes from: OS entropy, independent derived seeds, and the Gaussian noise source.

Secrets of a run (docs/explanation/security.md): whoever holds the noise source's state can subtract the noise and read
the exact sum of the clipped updates of every round; whoever holds the sampler's state knows every cohort.
Both live only on the server, in the secret part of its checkpoints, never in a message or a published file.

* Seeds. A research run has one explicit seed s; each consumer gets its own ``derive_seed(s, purpose)`` =
  the first 63 bits of SHA-256("fed-dp/<purpose>/<s>"), so the seed the clients receive for their local
  shuffles ("local-training") reveals nothing about the noise seed ("noise") or the sampler's ("sampler").
  A real run draws every seed from OS entropy (``entropy_seed``).
* Noise sources. :class:`TorchNormal` takes its random bits from an explicit ``torch.Generator`` (reproducible from
  its seed: research runs and tests). :class:`SecureNormal` takes them from AES-256 in counter mode keyed with 32
  bytes of ``os.urandom`` (the ``cryptography`` package, which Flower installs): a cryptographically secure stream
  that cannot be predicted from earlier outputs. Both turn the bits into N(0, 1) values in float64 with one
  transform, :func:`gaussian_from_words` (Box–Muller on a 126-bit radius uniform and a 53-bit angle), so what is
  said of the noise holds for both, on every device.
* Noise on a grid (:func:`add_on_grid`). A float32 Gaussian sample scaled by s, fl32(z·s), skips float32 values
  (Mironov 2012; Jin, McMurtry, Rubinstein & Ohrimenko 2022): an output in such a gap is impossible when the sum
  under the noise is 0 and possible when it is ζ, which names the neighbour. Every noisy release of fed-dp is
  instead formed exactly on a grid Λ·ℤ with Λ = 2^(⌊log₂ s⌋ − 36): Λ·(round(S/Λ) + round(s·Y/Λ)), with Y the
  float64 sample, then rounded once to the model's dtype. The integer noise k = round(s·Y/Λ) does not depend on
  the data, and it takes every integer of |k| ≤ s·r_max/Λ, so every output possible under one neighbouring sum is
  possible under the other, with the probability of its own noise integer (docs/explanation/floating-point.md
  states the remaining likelihood-ratio bound).
"""

from __future__ import annotations

import hashlib
import math
import os
import secrets
import threading
from typing import Any

import torch

_BLOCK = 16  # bytes of one AES block
#: Random 64-bit words per pair of normal values: two for the radius (a 126-bit uniform), one for the angle.
WORDS_PER_PAIR = 3
#: The largest |value| the transform can give: sqrt(−2 ln 2⁻¹²⁶) ≈ 13.2 (the radius of the smallest uniform).
RADIUS_MAX = math.sqrt(2 * 126 * math.log(2))
_LOW_63 = 2**63 - 1
#: Λ = 2^(⌊log₂ s⌋ − GRID_BITS) for noise of std s: :func:`grid_step`.
GRID_BITS = 36


def entropy_seed() -> int:
    """A 63-bit seed from the operating system's entropy source."""
    return secrets.randbits(63)


def derive_seed(seed: int, purpose: str) -> int:
    """An independent 63-bit seed for ``purpose`` from a run's seed: SHA-256("fed-dp/<purpose>/<seed>")."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    digest = hashlib.sha256(f"fed-dp/{purpose}/{seed}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


#: Values computed per block: on the CPU 2²⁰ (8 MiB of float64 per temporary: few enough parallel regions per draw
#: that a loaded machine's thread contention does not dominate — 2¹⁶-value blocks took 1.0 s for 10⁷ values on 2
#: busy threads, 2²⁰ 0.12 s — and a draw's temporaries stay bounded); a GPU takes large blocks. The block size decides
#: which words make which pair, so a seeded stream is reproducible on one kind of device.
_VALUES_PER_BLOCK = {"cpu": 1 << 20, "cuda": 1 << 24}


def block_size(device: torch.device) -> int:
    """Values per block on ``device`` (an even number)."""
    return _VALUES_PER_BLOCK.get(device.type, _VALUES_PER_BLOCK["cpu"])


def gaussian_from_words(words: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """N(0, 1) values in float64 from uniform random 64-bit words (an int64 tensor of length 3h), written into ``out``
    (float64, length 2h, same device; a new tensor if None) and returned.

    Box–Muller, with the radius of both values of a pair from a 126-bit uniform: the first 2h words give
    U = a·2⁶³ + b ∈ [0, 2¹²⁶) (a, b: the top 63 bits of a word), u = (U + 1)·2⁻¹²⁶ ∈ (0, 1] and r = sqrt(−2 ln u) ≤
    :data:`RADIUS_MAX` ≈ 13.2, with ln u = log(u) for u ≤ ½ and log1p(−v) for u > ½, v = 1 − u formed exactly from the
    words' complements; so r keeps float64 resolution at both ends (near 0, r = sqrt(2v) ≥ 2⁻⁶²·⁵; in the tail, the
    step between reachable radii stays under the grid's 2⁻³⁶ up to r ≈ 11.3 and under a float32 cell of the output up
    to r ≈ 12.3; a pair falls beyond 11.3 with probability e^(−r²/2) < 10⁻²⁷). The last h words give the angle θ = (w >> 11)·2π·2⁻⁵³ ∈ [−π, π) (53 bits);
    the values are (r cos θ, r sin θ), all first components then all second ones. A pair shares its radius, so the
    radius must be that fine for the pair's outputs to be reachable under any shift of both (a 63-bit radius left
    holes beyond 8σ and near 0). Every operation is float64: a value is off the exact transform of its words by a few
    2⁻⁵² of its magnitude at most, far finer than the grid of :func:`add_on_grid` (2⁻³⁶ of the std).
    """
    if words.dtype != torch.int64 or words.ndim != 1 or words.numel() % WORDS_PER_PAIR:
        raise ValueError("words must be a flat int64 tensor of a length divisible by 3 (three 64-bit words per pair)")
    half = words.numel() // WORDS_PER_PAIR
    if out is None:
        out = torch.empty(2 * half, dtype=torch.float64, device=words.device)
    high = words[:half].bitwise_right_shift(1).bitwise_and_(_LOW_63)  # a ∈ [0, 2⁶³)
    low = words[half : 2 * half].bitwise_right_shift(1).bitwise_and_(_LOW_63)  # b ∈ [0, 2⁶³)
    upper = high >= 2**62  # u > ½ (up to the lowest of 2¹²⁶ values): the log of 1 − v
    angle, radius = out[:half], out[half:]  # become r cos θ and r sin θ in place
    small = high.double().mul_(2.0**-63).add_(low.double().add_(1.0).mul_(2.0**-126))  # u (where u ≤ ½)
    v = (_LOW_63 - high).double().mul_(2.0**-63).add_((_LOW_63 - low).double().mul_(2.0**-126))  # 1 − u exactly
    radius.copy_(torch.where(upper, torch.log1p(v.neg_()), torch.log(small)))
    radius.mul_(-2.0).sqrt_()
    angle.copy_(words[2 * half :].bitwise_right_shift(11)).mul_(2 * math.pi * 2.0**-53)
    sine = torch.sin(angle)
    angle.cos_().mul_(radius)
    radius.mul_(sine)
    return out


def grid_step(std: float) -> float:
    """Λ = 2^(⌊log₂ std⌋ − :data:`GRID_BITS`): the grid of a noisy release with noise std ``std`` (public: it depends
    on σ·ζ only, never on the data). Λ lies in (2⁻³⁷·std, 2⁻³⁶·std]."""
    if not (isinstance(std, (int, float)) and 2.0**-900 < std < 2.0**900):
        raise ValueError(f"noise std must be a number in (2^-900, 2^900), got {std!r}")
    return math.ldexp(1.0, math.frexp(std)[1] - 1 - GRID_BITS)


def add_on_grid(value: torch.Tensor, noise: torch.Tensor, step: float, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """fl(Λ·(round(value/Λ) + round(noise/Λ))) in ``dtype`` (a new tensor on ``noise``'s device), Λ = ``step`` a power
    of two; ``noise`` float64, ``value`` any float dtype, both flat and of one length. Computed block by block.

    Exact up to the final rounding into ``dtype``: dividing a float32 or float64 by a power of two and rounding to an
    integer are exact in float64, and so is the sum of the two integers while it is below 2⁵³ (beyond, IEEE addition
    rounds the exact integer sum, a function of that sum alone), and the product by Λ. So the result is a function
    of the integer a + k, a = round(value/Λ) (the data, moved by at most Λ/2 per coordinate) and k = round(noise/Λ)
    (the noise, which does not depend on the data): two neighbouring sums' releases differ only through a − a′,
    never through a rounding that depends on both; the rounding into ``dtype`` is post-processing.
    """
    if not (isinstance(step, float) and step > 0 and math.frexp(step)[0] == 0.5):
        raise ValueError(f"step must be a power of two, got {step!r}")
    if noise.dtype != torch.float64 or noise.ndim != 1 or value.shape != noise.shape:
        raise ValueError(f"noise must be a flat float64 tensor and value of its shape, got {noise.dtype} "
                         f"{tuple(noise.shape)} and {tuple(value.shape)}")
    scale = 1.0 / step
    out = torch.empty(noise.shape, dtype=dtype, device=noise.device)
    size = block_size(noise.device)
    for start in range(0, noise.numel(), size):
        block = noise[start : start + size].mul(scale).round_()
        block.add_(value[start : start + size].to(noise.device, torch.float64, copy=True).mul_(scale).round_())
        out[start : start + size] = block.mul_(step)
    return out


def _normal_blocks(n: int, device: torch.device, words_of) -> torch.Tensor:
    """n values of N(0, 1) in float64 on ``device``, block by block: ``words_of(count)`` gives each block's int64
    words (3 per pair of values; the last block takes the words of whole pairs only)."""
    out = torch.empty(n + n % 2, dtype=torch.float64, device=device)
    size = block_size(device)
    for start in range(0, out.numel(), size):
        block = out[start : start + size]
        gaussian_from_words(words_of(block.numel() // 2 * WORDS_PER_PAIR), out=block)
    return out[:n]


class TorchNormal:
    """N(0, 1) draws from an explicit ``torch.Generator`` (reproducible from ``seed``): its 64-bit words through
    :func:`gaussian_from_words`."""

    kind = "torch"

    def __init__(self, seed: int, device: str | torch.device = "cpu") -> None:
        self.seed = int(seed)
        self.device = torch.device(device)
        self._generator = torch.Generator(device=self.device).manual_seed(self.seed)

    def normal(self, n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """n values of N(0, 1): float64 (:func:`gaussian_from_words`, block by block), then ``dtype``."""
        def words(count: int) -> torch.Tensor:  # every 64-bit word equally likely
            return torch.empty(count, dtype=torch.int64, device=self.device).random_(-(2**63), None,
                                                                                   generator=self._generator)
        return _normal_blocks(n, self.device, words).to(dtype)

    def prefetch(self, n: int) -> None:
        """Nothing to make ahead: the generator runs where the values are needed."""

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "seed": self.seed, "generator_state": self._generator.get_state().clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_kind(state, self.kind)
        self.seed = int(state["seed"])
        self._generator.set_state(state["generator_state"])


class SecureNormal:
    """N(0, 1) draws from AES-256-CTR keyed from ``os.urandom`` (see the module docstring).

    Each draw of n values reads 24·⌈n/2⌉ keystream bytes (whole AES blocks): three 64-bit words per pair, turned into
    float64 values by :func:`gaussian_from_words` on ``device`` (the words are copied there, 12 bytes per value).
    :meth:`prefetch` produces the keystream of the next draw in a background thread (into page-locked memory when
    the device is a GPU, so the copy overlaps too), while the caller does other work (the users' training): the
    bytes are the same, only made earlier. State: the key, the initial counter and the number of blocks consumed, so
    a resumed stream continues exactly where it stopped (bytes made ahead and not consumed are made again then).
    """

    kind = "secure"

    def __init__(self, device: str | torch.device = "cpu") -> None:
        try:
            from cryptography.hazmat.primitives.ciphers import Cipher  # noqa: F401
        except ImportError as error:  # pragma: no cover - Flower depends on cryptography
            raise ValueError("secure noise needs the 'cryptography' package: pip install cryptography") from error
        self.device = torch.device(device)
        self._key = os.urandom(32)
        self._nonce = os.urandom(_BLOCK)
        self._blocks = 0
        self._encryptor = self._at(0)
        self._zeros = b""
        self._ahead: list[torch.Tensor] = []  # keystream made ahead, in stream order, not yet consumed
        self._worker: threading.Thread | None = None

    def _at(self, blocks: int):
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        counter = (int.from_bytes(self._nonce, "big") + blocks) % 2 ** (8 * _BLOCK)
        return Cipher(algorithms.AES(self._key), modes.CTR(counter.to_bytes(_BLOCK, "big"))).encryptor()

    def _make(self, size: int) -> torch.Tensor:
        """The next ``size`` bytes of the keystream (a multiple of 16) as a uint8 tensor (page-locked for a GPU)."""
        if len(self._zeros) < size:
            self._zeros = bytes(size)
        # update_into wants room for one more block than it writes
        out = torch.empty(size + _BLOCK - 1, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        written = self._encryptor.update_into(memoryview(self._zeros)[:size], memoryview(out.numpy()))
        if written != size:  # pragma: no cover - CTR mode is a stream: it writes what it reads
            raise RuntimeError(f"AES-CTR wrote {written} bytes for {size}")
        return out[:size]

    def _join(self) -> None:
        if self._worker is not None:
            self._worker.join()
            self._worker = None

    def prefetch(self, n: int) -> None:
        """Start making the keystream of a draw of ``n`` values in a background thread; the next :meth:`normal` takes
        it (joining the thread). The stream, its state and the values drawn are the same with or without it."""
        self._join()
        size = -(-8 * WORDS_PER_PAIR * ((n + 1) // 2) // _BLOCK) * _BLOCK  # whole AES blocks
        if len(self._zeros) < size:
            self._zeros = bytes(size)
        self._worker = threading.Thread(target=lambda: self._ahead.append(self._make(size)), daemon=True)
        self._worker.start()

    def _bytes(self, count: int) -> torch.Tensor:
        """The next ``count`` keystream bytes (a multiple of 16: whole AES blocks are consumed), from what was made
        ahead first, as a uint8 tensor."""
        self._join()
        parts, needed = [], count
        while needed and self._ahead:
            first = self._ahead[0]
            parts.append(first[:needed])
            if first.numel() > needed:
                self._ahead[0] = first[needed:]
            else:
                self._ahead.pop(0)
            needed -= parts[-1].numel()
        if needed:
            parts.append(self._make(needed))
        self._blocks += count // _BLOCK
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def normal(self, n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """n values of N(0, 1): float64 (:func:`gaussian_from_words`, block by block), then ``dtype``."""
        def words(count: int) -> torch.Tensor:  # 8 keystream bytes per word, block by block (whole AES blocks)
            return self._bytes(8 * count + (8 * count) % _BLOCK)[: 8 * count].view(torch.int64).to(
                self.device, non_blocking=True)
        return _normal_blocks(n, self.device, words).to(dtype)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "key": bytes(self._key), "nonce": bytes(self._nonce), "blocks": self._blocks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_kind(state, self.kind)
        self._join()
        self._ahead.clear()
        self._key, self._nonce, self._blocks = bytes(state["key"]), bytes(state["nonce"]), int(state["blocks"])
        self._encryptor = self._at(self._blocks)


def _check_kind(state: dict[str, Any], kind: str) -> None:
    if state.get("kind") != kind:
        raise ValueError(f"noise source state is of kind {state.get('kind')!r}, this source is {kind!r}; a run "
                         "resumes with the noise source it started with")


NoiseSource = TorchNormal | SecureNormal


def make_noise_source(kind: str, seed: int | None, device: str | torch.device = "cpu") -> NoiseSource:
    """``"torch"``: a reproducible generator (``seed``, or one from OS entropy); ``"secure"``: AES-CTR keyed from
    OS entropy (an explicit seed is refused: it would make the noise reproducible by whoever knows it)."""
    if kind == "secure":
        if seed is not None:
            raise ValueError("secure noise is keyed from OS entropy and cannot take a seed; use the 'torch' noise "
                             "source for a reproducible research run")
        return SecureNormal(device)
    if kind == "torch":
        return TorchNormal(entropy_seed() if seed is None else seed, device)
    raise ValueError(f"noise source must be 'torch' or 'secure', got {kind!r}")
