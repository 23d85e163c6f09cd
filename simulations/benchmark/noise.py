"""The ``noise`` and ``secure-noise`` sections of ``fed-dp benchmark``: independent, BandMF and BLT noise steps
against one Gaussian draw, their memory and the error their strategies optimize; the secure source against
``torch.randn``."""

from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from fed_dp.factorization import optimize_toeplitz
from fed_dp.noise import Privatizer
from fed_dp.randomness import SecureNormal, TorchNormal
from fed_dp.simulations.benchmark.measure import sync, table, timed


def _resident_bytes() -> int | None:
    """This process's resident memory now (Linux /proc; None elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def _noise_steps(privatizers: dict[str, Privatizer], dim: int, steps: int) -> dict[str, list[float]]:
    """``steps`` timed steps of every privatizer and of one N(0, I_d) draw, interleaved (a slow phase of a
    shared machine hits all of them), plus one read of the largest buffer (``buffer read``)."""
    generator = torch.Generator().manual_seed(1)
    largest = max((p.buffer for p in privatizers.values() if p.buffer is not None), key=torch.Tensor.numel, default=None)
    times: dict[str, list[float]] = {"gaussian": [], "buffer read": [], **{name: [] for name in privatizers}}
    for _ in range(steps):
        times["gaussian"].append(timed(lambda: torch.randn(dim, generator=generator))[0])
        if largest is not None:
            times["buffer read"].append(timed(largest.sum)[0])
        for name, privatizer in privatizers.items():
            times[name].append(timed(privatizer.next_noise)[0])
    return times


def bench_noise(dim: int, bands: int, horizon: int, buffers: tuple[int, ...], steps: int, log=print) -> dict[str, Any]:
    """Independent, BandMF (b bands) and BLT (each ℓ in ``buffers``) noise steps at d = ``dim`` against one
    N(0, I_d) draw, side by side; their state's memory; and the error each strategy optimizes at T = horizon.

    Error: sens² · (1/T)·‖A C⁻¹‖_F² (prefix sums), the expected squared error per round of the noise on the
    running sums of updates at σ = 1, with sens the sensitivity of all the participations the separation
    allows: at min-separation b (⌈T/b⌉ participations, what BandMF with b bands is built for; the BLTs are
    optimized for it), and with one participation (BandMF's strategy unchanged, a BLT optimized for it).
    At equal sensitivity-scaled error the mechanisms have equal ε, so these compare noise at matched ε.
    Strategy optimizations are timed cold (a fresh cache folder), including T = 10,000 with b = 1,024.
    """
    from fed_dp.blt import blt_error, optimize_blt
    from fed_dp.factorization import banded_error, identity_strategy

    k = -(-horizon // bands)
    optimize: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as cache:
        optimize[f"BandMF T = {horizon}, b = {bands}"], strategy = timed(lambda: optimize_toeplitz(horizon, bands, cache_dir=cache))
        optimize[f"BandMF T = {horizon}, b = {bands}, from the cache"] = timed(lambda: optimize_toeplitz(horizon, bands, cache_dir=cache))[0]
        blts, single = {}, {}
        for count in buffers:
            optimize[f"BLT T = {horizon}, {count} buffers"], blts[count] = timed(
                lambda: optimize_blt(horizon, count, separation=bands, cache_dir=cache))
            single[count] = optimize_blt(horizon, count, separation=horizon, cache_dir=cache)
        large_t, large_b = (5 * horizon, 16 * bands)  # T = 10,000, b = 1,024 at full size
        optimize[f"BandMF T = {large_t:,}, b = {large_b:,}"] = timed(lambda: optimize_toeplitz(large_t, large_b, cache_dir=cache))[0]
        optimize[f"BLT T = {large_t:,}, 4 buffers"] = timed(lambda: optimize_blt(large_t, 4, separation=bands, cache_dir=cache))[0]
    for name, seconds in optimize.items():
        log(f"  strategy {name}: {seconds:.2f} s")

    identity = identity_strategy(horizon)
    rows = [{"name": "independent", "state_vectors": 0,
             "error_min_sep": banded_error(identity, separation=bands), "error_one": banded_error(identity, separation=horizon)},
            {"name": f"BandMF b = {bands}", "state_vectors": bands - 1,
             "error_min_sep": banded_error(strategy, separation=bands), "error_one": banded_error(strategy, separation=horizon)}]
    rows += [{"name": f"BLT {count} buffers", "state_vectors": count,
              "error_min_sep": blt_error(blts[count], separation=bands), "error_one": blt_error(single[count], separation=horizon)}
             for count in buffers]
    privatizers, growth = {}, {}
    for row, mechanism in zip(rows, [None, strategy] + [blts[count] for count in buffers]):
        before = _resident_bytes()
        privatizers[row["name"]] = privatizer = Privatizer(mechanism, noise_std=1.0, dim=dim, seed=0)
        for _ in range(min(bands, horizon - steps)):  # fill the buffers first: untouched zero pages would be cheap
            privatizer.next_noise()
        after = _resident_bytes()
        growth[row["name"]] = None if before is None or after is None else after - before
    times = _noise_steps(privatizers, dim, steps)
    gaussian = statistics.median(times["gaussian"])
    bandmf_error = rows[1]["error_min_sep"], rows[1]["error_one"]
    for row in rows:
        privatizer = privatizers[row["name"]]
        step = statistics.median(times[row["name"]])
        row.update(step_seconds=step, ratio=step / gaussian,
                   buffer_bytes=0 if privatizer.buffer is None else privatizer.buffer.numel() * privatizer.buffer.element_size(),
                   resident_growth_bytes=growth[row["name"]],
                   error_min_sep_vs_bandmf=row["error_min_sep"] / bandmf_error[0],
                   error_one_vs_bandmf=row["error_one"] / bandmf_error[1])
    return {"dim": dim, "bands": bands, "horizon": horizon, "participations": k, "steps": steps,
            "gaussian_seconds": gaussian, "buffer_read_seconds": statistics.median(times["buffer read"]),
            "mechanisms": rows, "optimize_seconds": optimize}


def format_noise(r: dict[str, Any]) -> str:
    d, b, T, k = r["dim"], r["bands"], r["horizon"], r["participations"]
    rows = [[row["name"], f"{1e3 * row['step_seconds']:.1f}", f"{row['ratio']:.2f}×",
             f"{row['state_vectors']}·d = {row['buffer_bytes'] / 2**30:.2f} GiB",
             "" if row["resident_growth_bytes"] is None else f"{row['resident_growth_bytes'] / 2**30:.2f} GiB",
             f"{row['error_min_sep']:.1f} ({row['error_min_sep_vs_bandmf']:.3f})",
             f"{row['error_one']:.2f} ({row['error_one_vs_bandmf']:.3f})"] for row in r["mechanisms"]]
    header = ["noise", "step ms", "vs draw", "state (float64)", "RSS growth", f"error, min-sep {b} (vs BandMF)",
              "error, 1 participation (vs BandMF)"]
    lines = [f"d = {d:.0e}, median of {r['steps']} interleaved steps; one N(0, I_d) draw: {1e3 * r['gaussian_seconds']:.1f} ms; "
             f"reading the (b − 1)×d ring once (BandMF's memory-bandwidth floor): {1e3 * r['buffer_read_seconds']:.1f} ms "
             f"({r['buffer_read_seconds'] / r['gaussian_seconds']:.2f}× the draw)",
             table(header, rows),
             f"error = sens²·‖A C⁻¹‖²_F/T at T = {T:,} (prefix sums, σ = 1): with min-separation {b} every user can take "
             f"part {k} times (the BLTs are optimized for it); with one participation the BLT is optimized for that",
             "strategy optimization (cold): " + "; ".join(f"{name} {seconds:.2f} s" for name, seconds in r["optimize_seconds"].items())]
    return "\n".join(lines)


def bench_secure_noise(dim: int, steps: int, devices: list[str]) -> dict[str, Any]:
    """N(0, I_d) in float64 from the secure source (AES-256-CTR keyed from os.urandom) and from the seeded torch source
    (both through ``fed_dp.randomness.gaussian_from_words``), against ``torch.randn`` in float32 (a draw without the
    resolution a release needs) on the same device, and one whole release of independent noise
    (``Privatizer.privatize``: draw, grid, round to float32) against adding a ``torch.randn`` draw to the sum in
    float32 as before: medians of ``steps`` draws each, interleaved, and their ratios."""
    rows = []
    for device in devices:
        resolved = torch.device(device)
        secure, seeded, generator = SecureNormal(device), TorchNormal(0, device), torch.Generator(device=device).manual_seed(0)
        privatizer = Privatizer(None, noise_std=1.0, dim=dim, seed=1, device=device)
        total = torch.randn(dim, generator=generator, device=device)
        draws = {"secure": lambda: secure.normal(dim), "torch source": lambda: seeded.normal(dim),
                 "randn": lambda: torch.randn(dim, generator=generator, device=device),
                 "release": lambda: privatizer.privatize(total),
                 "float32 release": lambda: torch.randn(dim, generator=generator, device=device).add_(total)}
        for draw in draws.values():  # warm-up
            draw()
        times: dict[str, list[float]] = {name: [] for name in draws}
        for _ in range(steps):
            for name, draw in draws.items():
                sync(resolved)
                times[name].append(timed(lambda: (draw(), sync(resolved)))[0])
        median = {name: statistics.median(values) for name, values in times.items()}
        rows.append({"device": device, "dim": dim, "secure_seconds": median["secure"], "torch_seconds": median["randn"],
                     "torch_source_seconds": median["torch source"], "throughput_ratio": median["randn"] / median["secure"],
                     "torch_source_ratio": median["randn"] / median["torch source"],
                     "release_seconds": median["release"], "float32_release_seconds": median["float32 release"],
                     "steps": steps})
    return {"rows": rows}


def format_secure_noise(r: dict[str, Any]) -> str:
    return "\n".join(
        f"{row['device']}: d = {row['dim']:.0e}: float64 N(0, I_d) from the secure source {1e3 * row['secure_seconds']:.1f} ms, "
        f"from the seeded torch source {1e3 * row['torch_source_seconds']:.1f} ms; torch.randn in float32 "
        f"{1e3 * row['torch_seconds']:.1f} ms: secure throughput {row['throughput_ratio']:.2f}× torch.randn's (torch source "
        f"{row['torch_source_ratio']:.2f}×). A release on the grid {1e3 * row['release_seconds']:.1f} ms against "
        f"{1e3 * row['float32_release_seconds']:.1f} ms for a float32 draw added in float32 "
        f"({row['release_seconds'] / row['float32_release_seconds']:.2f}×)"
        for row in r["rows"])
