"""The ``accounting`` section of ``fed-dp benchmark``: ε, the per-round ε schedule and σ calibration, from cold."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fed_dp.accounting import calibrate_noise_multiplier, epsilon, epsilon_schedule
from fed_dp.config import PrivacyConfig
from fed_dp.simulations.benchmark.measure import table, timed


def bench_accounting(rounds: int, target_epsilon: float) -> dict[str, Any]:
    """ε after ``rounds`` Poisson-sampled Gaussian rounds (PLD), the whole per-round schedule (RDP and PLD),
    and σ calibration (PLD and RDP), each from cold (memos cleared)."""
    config = PrivacyConfig(num_users=100_000, expected_cohort=1_000, rounds=rounds, noise_multiplier=1.0,
                           delta=1e-6, accountant="pld")
    out: dict[str, Any] = {"rounds": rounds, "q": config.sampling_rate, "delta": config.delta,
                           "target_epsilon": target_epsilon}

    def cold(fn: Callable[[], Any]) -> tuple[float, Any]:
        epsilon.cache_clear()
        epsilon_schedule.cache_clear()
        return timed(fn)

    out["epsilon_seconds"], out["epsilon"] = cold(lambda: epsilon(config))
    for accountant in ("rdp", "pld"):
        which = config.replace(accountant=accountant)
        seconds, schedule = cold(lambda: epsilon_schedule(which))
        out[f"schedule_{accountant}_seconds"], out[f"schedule_{accountant}_exact_rounds"] = seconds, len(schedule.exact_rounds)
        out[f"schedule_{accountant}_last"] = schedule.epsilons[-1]
        out[f"calibrate_{accountant}_seconds"], out[f"calibrated_sigma_{accountant}"] = cold(
            lambda: calibrate_noise_multiplier(which, target_epsilon))
    return out


def format_accounting(r: dict[str, Any]) -> str:
    head = f"Poisson q = {r['q']:g}, σ = 1, δ = {r['delta']:g}, T = {r['rounds']:,} rounds"
    rows = [["ε after T rounds, PLD (one accountant)", f"{r['epsilon_seconds']:.2f}", f"ε = {r['epsilon']:.3f}"],
            ["per-round schedule, RDP (exact every round)", f"{r['schedule_rdp_seconds']:.2f}",
             f"ε(T) = {r['schedule_rdp_last']:.3f}"],
            ["per-round schedule, PLD", f"{r['schedule_pld_seconds']:.2f}",
             f"exact at {r['schedule_pld_exact_rounds']} rounds, ε(T) = {r['schedule_pld_last']:.3f}"],
            [f"calibrate σ for ε = {r['target_epsilon']:g}, PLD", f"{r['calibrate_pld_seconds']:.2f}",
             f"σ = {r['calibrated_sigma_pld']:.6f}"],
            [f"calibrate σ for ε = {r['target_epsilon']:g}, RDP", f"{r['calibrate_rdp_seconds']:.2f}",
             f"σ = {r['calibrated_sigma_rdp']:.6f}"]]
    return head + "\n" + table(["accounting", "seconds", "result"], rows)
