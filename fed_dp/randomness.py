"""Where the randomness of a run comes from: OS entropy, independent derived seeds, and the Gaussian noise source.

Secrets of a run (docs/explanation/security.md): whoever holds the noise source's state can subtract the noise and read
the exact sum of the clipped updates of every round; whoever holds the sampler's state knows every cohort.
Both live only on the server, in the secret part of its checkpoints, never in a message or a published file.

* Seeds. A research run has one explicit seed s; each consumer gets its own ``derive_seed(s, purpose)`` =
  the first 63 bits of SHA-256("fed-dp/<purpose>/<s>"), so the seed the clients receive for their local
  shuffles ("local-training") reveals nothing about the noise seed ("noise") or the sampler's ("sampler").
  A real run draws every seed from OS entropy (``entropy_seed``).
* Noise sources. :class:`TorchNormal` draws N(0, 1) with an explicit ``torch.Generator`` (reproducible from its
  seed: research runs and tests). :class:`SecureNormal` draws them from AES-256 in counter mode keyed with 32
  bytes of ``os.urandom`` (the ``cryptography`` package, which Flower installs): a cryptographically secure
  stream that cannot be predicted from earlier outputs. Both are Gaussian only up to floating point, like
  every floating-point DP implementation: SecureNormal uses the Box–Muller transform with a 53-bit uniform
  for the radius, so its tails reach sqrt(2·53·ln 2) ≈ 8.6 standard deviations.
"""

from __future__ import annotations

import hashlib
import math
import os
import secrets
from typing import Any

import torch

#: Box–Muller's radius uses a 53-bit uniform u ∈ (0, 1]: u = (k + 1)·2⁻⁵³ for a 53-bit integer k.
_MANTISSA = 53
_BLOCK = 16  # bytes of one AES block


def entropy_seed() -> int:
    """A 63-bit seed from the operating system's entropy source."""
    return secrets.randbits(63)


def derive_seed(seed: int, purpose: str) -> int:
    """An independent 63-bit seed for ``purpose`` from a run's seed: SHA-256("fed-dp/<purpose>/<seed>")."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    digest = hashlib.sha256(f"fed-dp/{purpose}/{seed}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class TorchNormal:
    """N(0, 1) draws from an explicit ``torch.Generator`` (reproducible from ``seed``)."""

    kind = "torch"

    def __init__(self, seed: int, device: str | torch.device = "cpu") -> None:
        self.seed = int(seed)
        self.device = torch.device(device)
        self._generator = torch.Generator(device=self.device).manual_seed(self.seed)

    def normal(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(n, generator=self._generator, device=self.device, dtype=dtype)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "seed": self.seed, "generator_state": self._generator.get_state().clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_kind(state, self.kind)
        self.seed = int(state["seed"])
        self._generator.set_state(state["generator_state"])


class SecureNormal:
    """N(0, 1) draws from AES-256-CTR keyed from ``os.urandom`` (see the module docstring).

    Each draw of n values reads 12·⌈n/2⌉ keystream bytes (rounded up to whole AES blocks): per pair, 8 bytes
    give the radius sqrt(−2 ln u₁) from a 53-bit uniform u₁ ∈ (0, 1] (float64), 4 bytes the angle
    θ = 2π·u₂ (float32), and the pair is (r cos θ, r sin θ). State: the key, the initial counter and the
    number of blocks used, so a resumed stream continues exactly where it stopped.
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

    def _at(self, blocks: int):
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        counter = (int.from_bytes(self._nonce, "big") + blocks) % 2 ** (8 * _BLOCK)
        return Cipher(algorithms.AES(self._key), modes.CTR(counter.to_bytes(_BLOCK, "big"))).encryptor()

    def _bytes(self, count: int) -> bytearray:
        """The next ``count`` keystream bytes (whole AES blocks are consumed), written in place into a buffer."""
        blocks = -(-count // _BLOCK)
        self._blocks += blocks
        size = blocks * _BLOCK
        if len(self._zeros) < size:
            self._zeros = bytes(size)
        out = bytearray(size + _BLOCK - 1)  # update_into wants room for one more block than it writes
        written = self._encryptor.update_into(memoryview(self._zeros)[:size], out)
        return out[:written] if written != size else memoryview(out)[:size]

    def normal(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        half = (n + 1) // 2
        raw = torch.frombuffer(self._bytes(12 * half), dtype=torch.uint8)
        bits = raw[: 8 * half].view(torch.int64) & ((1 << _MANTISSA) - 1)
        u1 = (bits.to(torch.float64) + 1.0).mul_(2.0**-_MANTISSA)  # (0, 1]
        radius = u1.log_().mul_(-2.0).sqrt_().to(torch.float32)
        angle = (raw[8 * half : 12 * half].view(torch.int32).to(torch.float32) + 2.0**31).mul_(2 * math.pi / 2.0**32)
        pairs = torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)])
        return pairs[:n].to(self.device, dtype)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "key": bytes(self._key), "nonce": bytes(self._nonce), "blocks": self._blocks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_kind(state, self.kind)
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
