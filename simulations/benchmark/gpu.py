"""The ``gpu`` section of ``fed-dp benchmark`` (CUDA only): the engine's vectorized path on W1's data at scale
against the hardware's practical limit for the same work."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import torch

from fed_dp.accounting import epsilon_schedule
from fed_dp.clients.training import resolve_device
from fed_dp.simulations.benchmark.measure import table
from fed_dp.simulations.benchmark.w1 import W1Spec, engine_cohorts, engine_run, plain_training_seconds
from fed_dp.simulations.tasks import models
from fed_dp.simulations.tasks.builtin import w1_task


#: The models of the ``gpu`` section: W1's CNN and the seeds' CIFAR CNN (411,466 parameters), on W1's data.
GPU_MODELS = {"w1-cnn": models.w1_cnn, "cifar-cnn": models.cifar_cnn}


def _counts(events: Iterable[tuple[str, int]]) -> tuple[int, int]:
    """Host-to-device copies and stream/device synchronizations among a CUDA profile's (event name, count)
    pairs (``torch.profiler`` names them ``Memcpy HtoD (...)``, ``cudaStreamSynchronize``,
    ``cudaDeviceSynchronize``)."""
    events = list(events)
    copies = sum(count for name, count in events if name.startswith("Memcpy HtoD"))
    syncs = sum(count for name, count in events if name in ("cudaStreamSynchronize", "cudaDeviceSynchronize"))
    return copies, syncs


def transfer_summary(run: Iterable[tuple[str, int]], rounds: int,
                     one_round: Iterable[tuple[str, int]]) -> dict[str, float]:
    """Host-to-device copies and synchronizations per round: the profile of a run of ``rounds`` (≥ 2) rounds
    less that of a run of one round, over ``rounds`` − 1, so that the work both runs do once (moving every
    user's data to the device, building the model) is not counted as a round's."""
    if rounds < 2:
        raise ValueError(f"per-round transfers need a run of at least 2 rounds, got {rounds}")
    (copies, syncs), (copies_1, syncs_1) = _counts(run), _counts(one_round)
    return {"h2d_copies_per_round": (copies - copies_1) / (rounds - 1),
            "syncs_per_round": (syncs - syncs_1) / (rounds - 1)}


def _profile(run: Callable[[], Any]) -> list[tuple[str, int]]:
    """(event name, count) of ``run`` under the CUDA profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
    return [(e.key, e.count) for e in prof.key_averages()]


def bench_gpu(spec: W1Spec, users: int, cohort: int, rounds: int, device: str, log=print) -> dict[str, Any]:
    """W1's data at scale on ``device``, for each model of :data:`GPU_MODELS`: the engine's vectorized path
    against the hardware's practical limit for the same work, one model trained by SGD on the same examples
    (every round's examples of the sampled users, staged on the device), in batches of all of a round's examples
    and of 1,024 (``plain_training_seconds``). Users/s and the engine's ratio to each; on CUDA also the peak
    memory and, from a profile of the engine's rounds, host-to-device copies and synchronizations per round.

    Like for like: the engine's time is the sum of its rounds (its one-time move of every user's data to the
    device is reported apart); both sides are warmed up once first."""
    resolved = resolve_device(device)
    data = w1_task(users=users, examples=spec.examples)
    privacy = replace(spec, rounds=rounds).privacy(cohort=cohort, users=users)
    cohorts = engine_cohorts(privacy, spec.seed)
    epsilon_schedule(privacy)
    rows = []
    for name, build in GPU_MODELS.items():
        task = replace(data, model=build)
        engine = lambda: engine_run(task, privacy, spec.training(), seed=spec.seed, vectorized=True, device=device)  # noqa: E731
        one_round = lambda: engine_run(task, replace(privacy, rounds=1), spec.training(), seed=spec.seed,  # noqa: E731
                                       vectorized=True, device=device)
        one_round()  # warm-up
        if resolved.type == "cuda":
            torch.cuda.reset_peak_memory_stats(resolved)
        result = engine()
        seconds = sum(result["round_seconds"])
        row = {"model": name, "parameters": sum(p.numel() for p in build().parameters()),
               "engine_seconds": seconds, "engine_setup_seconds": result["seconds"] - seconds,
               "users_per_second": result["users"] / seconds,
               "peak_gib": torch.cuda.max_memory_allocated(resolved) / 2**30 if resolved.type == "cuda" else None}
        examples = max(1, max(len(c) for c in cohorts) * spec.examples)
        for label, batch in (("all", examples), ("1024", 1024)):
            training = replace(spec.training(), batch_size=batch)
            plain_training_seconds(task, cohorts[:1], training, device=device)  # warm-up
            limit = plain_training_seconds(task, cohorts, training, device=device, staged=True)
            row[f"limit_{label}_users_per_second"] = result["users"] / limit
            row[f"ratio_to_limit_{label}"] = row["users_per_second"] / row[f"limit_{label}_users_per_second"]
        row.update(transfer_summary(_profile(engine), rounds, _profile(one_round)) if resolved.type == "cuda" else
                   {"h2d_copies_per_round": None, "syncs_per_round": None})
        log(f"  {name}: engine {row['users_per_second']:.0f} users/s, limit {row['limit_all_users_per_second']:.0f} "
            f"(batch = a round's examples) and {row['limit_1024_users_per_second']:.0f} (batch 1,024) users/s")
        rows.append(row)
    return {"device": str(resolved), "users": users, "cohort": cohort, "rounds": rounds, "rows": rows,
            "name": torch.cuda.get_device_name(resolved) if resolved.type == "cuda" else "cpu"}


def format_gpu(r: dict[str, Any]) -> str:
    def number(value: float | None, form: str) -> str:
        return "" if value is None else format(value, form)

    rows = [[row["model"], f"{row['parameters']:,}", f"{row['users_per_second']:.0f}",
             f"{row['limit_all_users_per_second']:.0f}", f"{row['ratio_to_limit_all']:.2f}×",
             f"{row['limit_1024_users_per_second']:.0f}", f"{row['ratio_to_limit_1024']:.2f}×",
             number(row["peak_gib"], ".2f"), number(row["h2d_copies_per_round"], ".0f"),
             number(row["syncs_per_round"], ".0f")] for row in r["rows"]]
    header = ["model", "parameters", "engine users/s", "limit (batch = round)", "engine/limit", "limit (batch 1,024)",
              "engine/limit", "peak GiB", "H2D copies/round", "syncs/round"]
    return (f"{r['name']}: W1's data, {r['users']:,} users, {r['cohort']:,} per round, {r['rounds']} rounds; the "
            "engine's vectorized path against one model trained on the same examples (the limit)\n" + table(header, rows))
