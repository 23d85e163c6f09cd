"""L2 clipping of whole user updates and in the scaled geometry of
scale-then-privatize, exact in floating point (docs/explanation/mechanism.md, server-optimizers.md).

    u_i = clip(Δ_i, ζ) = Δ_i · f_i,   f_i ≤ min(1, ζ / ‖Δ_i‖₂)      (norm over all tensors: one flat vector)

Scale-then-privatize (seed 000 Alg. 8; docs/explanation/server-optimizers.md) clips in the preconditioned space:

    u_i = clip(s_t ⊙ Δ_i, ζ)

The clip is the sensitivity bound of the whole mechanism, so it must hold for the vector that is released,
in floating point, at any model size: the float32 reductions of ``torch.linalg.vector_norm`` under-estimate
the norm of large vectors on the CPU (−1.1% at 10⁸ entries), the class of defect of Casacuberta et al.,
"Widespread underestimation of sensitivity in differentially private libraries" (CCS 2022). Here every norm
comes from one primitive with a proved error bound (:func:`l2_norm`, :func:`row_norms`), and the factor
from :func:`clip_factors` leaves exactly the margin that the rounding of the factor and of the product need,
so that ``l2_norm(released) ≤ ζ``, hence ‖released‖₂ ≤ ζ exactly, for every input.

A non-finite update is an error here, never silently zeroed: the server's validation decides what to do
with such a reply.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

#: w: every float64 partial sum of :func:`row_norms` adds at most this many squares.
CHUNK = 1 << 16
#: Elements converted to float64 at a time: 2 MiB on the CPU (the block stays in cache: measured fastest
#: of 2^18..2^21), 128 MiB on a GPU (fewer launches); memory stays O(d) in the input's dtype.
_BLOCK = {"cpu": 1 << 18, "cuda": 1 << 24}
#: Largest vector length that the error bound covers: three levels of sums of ≤ w terms (w³ = 2^48).
MAX_DIM = CHUNK**3
_U64 = 2.0**-53  # unit roundoff of float64 (round to nearest)
_U32 = 2.0**-24  # of float32


@dataclass(frozen=True)
class ClipResult:
    """A clipped update with its statistics.

    ``norm`` is :func:`l2_norm` of the input before clipping (an upper bound within 10⁻¹⁰ of ‖input‖₂);
    ``clipped`` tells whether it exceeds ζ, the bit that adaptive clipping counts (as its complement
    1[‖Δ‖ ≤ ζ]).
    """

    update: torch.Tensor
    norm: float
    clipped: bool


def _check_vector(update: torch.Tensor, what: str) -> None:
    if not isinstance(update, torch.Tensor) or update.ndim != 1:
        raise ValueError(f"{what} must be a flat 1-D tensor (see fed_dp.flat.ParamLayout)")
    if not update.dtype.is_floating_point:
        raise ValueError(f"{what} must be floating point, got {update.dtype}")
    if not bool(torch.isfinite(update).all()):
        raise ValueError(f"{what} contains NaN or Inf values; it cannot be clipped")


def _check_clip_norm(clip_norm: float) -> None:
    if not (isinstance(clip_norm, (int, float)) and clip_norm > 0 and clip_norm != float("inf")):
        raise ValueError(f"clip_norm must be a finite number > 0, got {clip_norm!r}")


def _round_up(value: float, ulps: int = 3) -> float:
    """``value`` moved up by ``ulps`` units in the last place: an upper bound of the exact quantity that a
    few float64 operations computed as ``value``."""
    for _ in range(ulps):
        value = math.nextafter(value, math.inf)
    return value


def _sum_height(dim: int) -> int:
    """Additions any one square goes through in :func:`row_norms`: chunk sums of ≤ w terms, then sums of
    ≤ w partial sums per level, in whatever order torch adds them (any order of n terms is ≤ n − 1 deep)."""
    height, terms = 0, max(int(dim), 1)
    while True:
        height += min(terms, CHUNK) - 1
        if terms <= CHUNK:
            return height
        terms = -(-terms // CHUNK)


def _check_dim(dim: int) -> None:
    if not (isinstance(dim, int) and 0 <= dim <= MAX_DIM):
        raise ValueError(f"dim must be an integer in [0, 2^48], got {dim!r}: the norm's error bound covers "
                         "three levels of sums of 2^16 terms")


@functools.lru_cache(maxsize=256)
def _inflation(dim: int, dtype: torch.dtype) -> float:
    """K(d) of :func:`l2_norm`: the computed sqrt(S̃) times K is ≥ ‖x‖₂ (proof in ``l2_norm``)."""
    height = _sum_height(dim) + (1 if dtype == torch.float64 else 0)  # float64 squares round once
    gamma = height * _U64 / (1 - height * _U64)
    return _round_up((1 - _U64) ** -2.5 / math.sqrt(1 - gamma))


def norm_relative_error(dim: int, dtype: torch.dtype = torch.float32) -> float:
    """η(d): ‖x‖₂ ≤ ``l2_norm(x)`` ≤ (1 + η)·‖x‖₂ for every finite x of length ``dim`` and this dtype.

    η = K² − 1 ≈ (h + 17)·2⁻⁵³ with h the summation depth (:func:`l2_norm`): 1.1·10⁻¹³ at d = 10³,
    7.4·10⁻¹² at d = 10⁸, 2.2·10⁻¹¹ at most (d ≤ 2^48). A float64 ``dtype`` adds the rounding of its
    squares (and, for entries below 10⁻¹⁵⁰, an absolute d·2⁻¹⁰⁷⁴ inside the square root).
    """
    _check_dim(dim)
    k = _inflation(dim, dtype)
    return _round_up(k * k - 1)


def _square_sums(rows: torch.Tensor) -> torch.Tensor:
    """Σ_j x_ij² in float64 for each row of an (n, m) block with m ≤ w, converting ≤ _BLOCK entries at a time.

    The squares of float32, bfloat16 or float16 numbers are exact in float64 (24 significant bits squared
    fit in 53, and their exponent range in float64's); float64 squares round once.
    """
    n, m = rows.shape
    out = torch.empty(n, dtype=torch.float64, device=rows.device)
    step = max(1, _BLOCK.get(rows.device.type, _BLOCK["cpu"]) // max(m, 1))
    for start in range(0, n, step):
        block = rows[start : start + step].to(torch.float64).unsqueeze(1)  # (b, 1, m)
        out[start : start + step] = torch.bmm(block, block.transpose(1, 2)).view(-1)  # b dot products
    return out


def _combine(partials: torch.Tensor) -> torch.Tensor:
    """Sum the (n, q) float64 partial sums over q, in sums of ≤ w terms per level (exact zero padding)."""
    while partials.shape[1] > CHUNK:
        pad = -partials.shape[1] % CHUNK
        partials = torch.nn.functional.pad(partials, (0, pad)).view(partials.shape[0], -1, CHUNK).sum(dim=2)
    return partials.sum(dim=1)


def _upper_bounds(sums: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """From computed sums of squares S̃ to upper bounds K(d)·sqrt(S̃ [+ d·2⁻¹⁰⁷⁴ for float64 input])."""
    if dtype == torch.float64:  # each float64 square may underflow by < 2⁻¹⁰⁷⁵: an absolute error
        sums = sums + dim * 2.0**-1074
    return sums.sqrt_().mul_(_inflation(dim, dtype))


def row_norms(matrix: torch.Tensor) -> torch.Tensor:
    """Upper bounds of ‖row i‖₂ for an (n, d) floating-point matrix: an (n,) float64 tensor on its device,
    within a relative ``norm_relative_error(d)`` (≤ 2.2·10⁻¹¹) of the exact norms.

    Same algorithm and bound as :func:`l2_norm`, row by row (batched dot products of the float64 rows for
    d ≤ w = 2^16, in whatever order the batched product adds; ``l2_norm`` itself for longer rows).
    """
    if not isinstance(matrix, torch.Tensor) or matrix.ndim != 2 or not matrix.dtype.is_floating_point:
        raise ValueError("matrix must be an (n, d) floating-point tensor")
    n, dim = matrix.shape
    _check_dim(dim)
    if dim > CHUNK:
        return torch.stack([l2_norm(row) for row in matrix]) if n else matrix.new_zeros(0, dtype=torch.float64)
    return _upper_bounds(_square_sums(matrix), dim, matrix.dtype)


def l2_norm(vector: torch.Tensor) -> torch.Tensor:
    """An upper bound N̄ of ‖x‖₂ as a 0-d float64 tensor on x's device: ‖x‖₂ ≤ N̄ ≤ (1 + η(d))·‖x‖₂.

    Algorithm: the squares x_j² in float64 (exact for float32/bfloat16/float16 input), summed over chunks of
    w = 2^16 consecutive entries, the chunk sums summed in groups of ≤ w (one level up to d = 2^32, two up to
    2^48). Whatever order torch adds in, each square goes through at most h = Σ_levels (terms − 1) float64
    additions (h = d − 1 for d ≤ w; 67,060 at d = 10⁸), so the computed sum S̃ satisfies
    |S̃ − S| ≤ γ_h·S with γ_h = hu/(1 − hu), u = 2⁻⁵³: each term is multiplied by at most h factors
    (1 + δ), |δ| ≤ u, and a product of h such factors is 1 + θ with |θ| ≤ γ_h (Higham, *Accuracy and
    Stability of Numerical Algorithms*, 2nd ed. 2002, Lemma 3.1 and §4.2; +1 to h for float64 input, whose
    squares round). Hence ‖x‖₂ = √S ≤ √(S̃/(1 − γ_h)). The square root and the final product each round by ≤ u, so
    returning fl(fl(√S̃)·K) with K ≥ (1 − u)^−2.5·(1 − γ_h)^−½ (rounded up three ulps) is ≥ ‖x‖₂; and as
    S̃ ≤ (1 + γ_h)·S it is ≤ K²·‖x‖₂ = (1 + η)·‖x‖₂ (:func:`norm_relative_error`).

    Cost: one float64 pass over x in blocks of 2^18 entries on the CPU (batched dot products); measured on
    1 CPU thread 0.5 ns per entry (14 µs at W1's d = 25,578; 49 ms at 10⁸), against 0.15 ns for
    ``torch.linalg.vector_norm`` and its −1.1·10⁻² error at 10⁸.
    """
    if not isinstance(vector, torch.Tensor) or vector.ndim != 1 or not vector.dtype.is_floating_point:
        raise ValueError("vector must be a flat 1-D floating-point tensor (see fed_dp.flat.ParamLayout)")
    dim = vector.numel()
    _check_dim(dim)
    vector = vector.contiguous()
    if dim <= CHUNK:  # one dot product of ≤ w exact squares: the same depth d − 1
        wide = vector.to(torch.float64)
        return _upper_bounds(torch.dot(wide, wide), dim, vector.dtype)
    full = dim // CHUNK * CHUNK
    partials = _square_sums(vector[:full].view(-1, CHUNK))  # one row per chunk of w entries
    if full < dim:
        partials = torch.cat([partials, _square_sums(vector[full:].unsqueeze(0))])
    return _upper_bounds(_combine(partials.unsqueeze(0)), dim, vector.dtype)[0]


def _product_dtype(dtype: torch.dtype) -> torch.dtype:
    """Clipped vectors are computed and released in float32 or wider, never in bfloat16/float16."""
    return torch.promote_types(dtype, torch.float32)


def round_down_float32(values: torch.Tensor) -> torch.Tensor:
    """Nonnegative float64 ``values`` as float32 no larger than them: the nearest float32, then one step towards
    0 where rounding went up (a factor applied in float32 must never exceed the float64 one it stands for)."""
    nearest = values.to(torch.float32)
    return torch.where(nearest.double() > values, torch.nextafter(nearest, torch.zeros_like(nearest)), nearest)


def _check_factor_args(clip_norm: float, dtype: torch.dtype) -> None:
    if not (isinstance(clip_norm, (int, float)) and 0 <= clip_norm < float("inf")):
        raise ValueError(f"clip_norm must be a finite number >= 0, got {clip_norm!r}")
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64 (clip in float32 or wider), got {dtype}")


@functools.lru_cache(maxsize=64)
def _margins(dim: int, dtype: torch.dtype) -> tuple[float, float, float]:
    """(T', M, A) of :func:`clip_factors` for this length and product dtype (floats rounded up)."""
    eta = norm_relative_error(dim, dtype)
    p, absolute = (_U32, 2.0**-120) if dtype == torch.float32 else (0.0, 2.0**-1000)
    # 3 ulps up (6u) cover the rounding of 1 + η, of the products, and the (1 + u) that 1 + 2⁻⁵³ cannot hold
    return _round_up((1 + eta) * (1 + 2 * _U64)), _round_up((1 + eta) * (1 + p)), absolute


def _limits(clip_norm: float, dim: int | None, dtype: torch.dtype) -> tuple[float, float]:
    """(L, c): keep a vector whose bound N̄ ≤ L; otherwise f = c/N̄ (before rounding into ``dtype``).

    L = fl(ζ/T') and c = fl(fl(fl(ζ − A)/M)·(1 − 4u)): every rounding is accounted for in
    :func:`clip_factors`' argument."""
    _check_factor_args(clip_norm, dtype)
    keep, margin, absolute = _margins(MAX_DIM if dim is None else dim, dtype)
    return clip_norm / keep, max(clip_norm - absolute, 0.0) / margin * (1 - 4 * _U64)


def clip_factors(norms: torch.Tensor, clip_norm: float, *, dim: int | None = None,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Factors f ∈ [0, 1] (float64 tensor, values representable in ``dtype``) such that for every vector x
    with ‖x‖₂ ≤ N̄ (``norms``: float64 UPPER BOUNDS, e.g. from :func:`l2_norm`/:func:`row_norms`) the
    released v = fl(f·x) satisfies ``l2_norm(v) ≤ clip_norm``, hence ‖v‖₂ ≤ ζ/(1 + η) exactly.

    ``dtype`` is that of the released product (float32 or float64); the product may be computed in float32
    or in float64 and then rounded to float32. ``dim`` is the vectors' length (None: any length ≤ 2^48, a
    margin 2·10⁻¹¹ instead of η(d)). ``clip_norm`` may be 0 (every nonzero vector gets f = 0).

    Argument, with η = η(d) of :func:`norm_relative_error`, u = 2⁻⁵³ and p = 2⁻²⁴ (float32) or 0 (float64):

    * f = 1 where N̄ ≤ L = fl(ζ/T'), T' ≥ (1 + η)(1 + u): then N̄(1 + η) ≤ ζ(1 + η)(1 + u)/T' ≤ ζ, v = x and
      l2_norm(v) ≤ (1 + η)‖x‖ ≤ (1 + η)N̄ ≤ ζ;
    * otherwise f = fl(c/N̄) with c = fl(fl(fl(ζ − A)/M)·(1 − 4u)) and M ≥ (1 + η)(1 + p)(1 + u): four
      roundings up of at most (1 + u) each against (1 − 4u), so f ≤ (ζ − A)/(N̄·M); then f is rounded DOWN
      into ``dtype``'s grid (so multiplying in either precision uses exactly f). Each coordinate of v is
      f·x_j rounded at most twice, |v_j| ≤ (1 + p)(1 + u)|f·x_j| + a (a < 2⁻¹⁴⁹ for a product landing among
      float32 subnormals), so ‖v‖ ≤ (1 + p)(1 + u)·f·N̄ + √d·a and l2_norm(v) ≤ (1 + η)‖v‖ ≤ ζ − A + A = ζ
      with A = 2⁻¹²⁰ ≥ (1 + η)·√(2^48)·2⁻¹⁴⁹ (float32; 2⁻¹⁰⁰⁰ for float64).

    The margin below ζ of a clipped vector is thus ≤ η + p + 6u + one ulp of f: at most 1.8·10⁻⁷ relative
    for float32 (about 9·10⁻⁸ on average), 3·10⁻¹¹ for float64; an unclipped vector is left unchanged.
    One vector's factor is also available as a Python float (:func:`clip_vector`, same formula and bits).
    """
    limit, numerator = _limits(clip_norm, dim, dtype)
    norms = torch.as_tensor(norms, dtype=torch.float64)
    # a true division (``scalar / tensor`` would multiply by a rounded reciprocal: two roundings)
    quotient = torch.full_like(norms, numerator).div_(norms).clamp_(max=1.0)
    if dtype == torch.float32:
        quotient = round_down_float32(quotient).double()
    return torch.where(norms <= limit, 1.0, quotient)


def _clip_factor_of(norm: float, clip_norm: float, dim: int, dtype: torch.dtype) -> float:
    """:func:`clip_factors` of one bound, in Python floats (no tensor operations: the per-user path)."""
    limit, numerator = _limits(clip_norm, dim, dtype)
    if norm <= limit:
        return 1.0
    quotient = min(numerator / norm, 1.0)
    if dtype == torch.float32:
        nearest = float(np.float32(quotient))
        return float(np.nextafter(np.float32(nearest), np.float32(0))) if nearest > quotient else nearest
    return quotient


def clip_factor(norms: torch.Tensor, clip_norm: float) -> torch.Tensor:
    """Kept for callers written before :func:`clip_factors`: the same factors, for float32 products."""
    return clip_factors(norms, clip_norm)


def clip_vector(vector: torch.Tensor, bound: float, norm: float | None = None) -> tuple[torch.Tensor, bool]:
    """(v, scaled): ``vector`` itself when l2_norm(vector) ≤ bound, else fl(f·vector) with the factor of
    :func:`clip_factors`, so ``l2_norm(v) ≤ bound`` always. Computed and returned in float32 or wider
    (bfloat16/float16 input is promoted to float32). ``norm``: its ``l2_norm`` if already computed."""
    dtype = _product_dtype(vector.dtype)
    norm = float(l2_norm(vector)) if norm is None else norm
    factor = _clip_factor_of(norm, bound, vector.numel(), dtype)
    if factor == 1.0:
        return vector.to(dtype), False
    return vector.to(dtype) * factor, True


def clip_update(update: torch.Tensor, clip_norm: float) -> ClipResult:
    """clip(u, ζ) for one flat update (see :func:`clip_factors`): l2_norm of the result ≤ ζ. Returns a new
    tensor (or ``update`` itself when it is within ζ), float32 for bfloat16/float16 input."""
    _check_clip_norm(clip_norm)
    _check_vector(update, "update")
    norm = float(l2_norm(update))
    clipped, _ = clip_vector(update, clip_norm, norm)
    return ClipResult(update=update.clone() if clipped is update else clipped, norm=norm, clipped=norm > clip_norm)


def clip_rows(updates: torch.Tensor, clip_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip every row of an (n, d) matrix of user updates; returns (clipped rows, float64 norms before).

    One pass of :func:`row_norms` and one product for a whole cohort (the vectorized path of the simulation
    engine), with the guarantee of :func:`clip_factors` for every row; row i is ``clip_update(updates[i],
    ζ).update`` up to the order of the norm's float64 additions (rarely one float32 ulp of the factor).
    """
    _check_clip_norm(clip_norm)
    if updates.ndim != 2:
        raise ValueError(f"updates must be an (n, d) matrix, got shape {tuple(updates.shape)}")
    if not bool(torch.isfinite(updates).all()):
        raise ValueError("updates contain NaN or Inf values; they cannot be clipped")
    dtype = _product_dtype(updates.dtype)
    norms = row_norms(updates)
    factors = clip_factors(norms, clip_norm, dim=updates.shape[1], dtype=dtype)
    return updates.to(dtype) * factors.to(dtype).unsqueeze(1), norms


def clip_scaled(delta: torch.Tensor, scale: torch.Tensor, clip_norm: float) -> ClipResult:
    """Scale-then-privatize clip: clip(s ⊙ Δ, ζ), the scaled vector that the user sends.

    ``scale`` is the server's broadcast s_t = 1/(sqrt(ν̂_{t−1}) + ε_s) (docs/explanation/server-optimizers.md); it must be
    positive and finite, with Δ's shape. The norm and the clip bit are those of s ⊙ Δ.
    """
    _check_vector(scale, "scale")
    if scale.shape != delta.shape:
        raise ValueError(f"scale has shape {tuple(scale.shape)}, update has {tuple(delta.shape)}")
    if not bool((scale > 0).all()):
        raise ValueError("scale must be positive in every coordinate")
    _check_vector(delta, "update")
    return clip_update(scale * delta, clip_norm)
