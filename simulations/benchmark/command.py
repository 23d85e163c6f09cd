"""``fed-dp benchmark``: the workloads of docs/explanation/benchmarks.md, measured side by side in one invocation.

    fed-dp benchmark [--runs 3] [--out DIR] [--only w1,scaling,noise,accounting,gpu,small-users,paths,finetune] [--smoke]

Sections (each prints a table; everything is also saved to ``DIR/benchmark.json`` with a figure
``DIR/benchmark.png``):

``w1``
    W1 (500 users × 32 CIFAR-shaped examples, W1 CNN, 10 rounds, expected cohort 50, 1 local epoch of
    batch 16 at lr 0.05, ζ = 1, σ = 1, FedAvg η = 1), ``--runs`` times each, on:

    - ``flower-dp``: Flower's ``DifferentialPrivacyServerSideFixedClipping(FedAvg)`` through
      ``run_simulation`` (``benchmark.flower_baseline``), Flower's default 2 CPUs per ClientApp;
    - ``flower-dp-1cpu``: the same with 1 CPU per ClientApp (two workers on two cores);
    - ``flower-dp-flwr-run``: the same apps launched with ``flwr run`` (``simulations/benchmark/flower_baseline_app``),
      one virtual SuperNode per user, 1 CPU per ClientApp: the project's Flower apps' launcher, so that
      ``fed-dp-flower`` against it compares the apps and against ``flower-dp`` the whole experience;
    - ``fed-dp-flower``: the project's ServerApp/ClientApp through ``flwr run`` (Flower's simulation
      engine), one virtual SuperNode per user, 1 CPU per ClientApp;
    - ``engine``: the in-process engine (auto path: one user at a time on the CPU, vectorized on CUDA),
      all torch threads; ``engine-1thread``: the same with one torch thread; ``engine-vectorized``: the
      ``torch.func`` path forced;
    - ``plain``: non-private, non-federated minibatch SGD over the same number of examples in the same
      minibatches (the local-training compute alone, the floor of every system above).

    Time = wall time of the 10 rounds (Flower: ``strategy.start``; the project's apps: the sum of the
    server's ``round_seconds`` in its secret diagnostics; the engine: its ``run`` call). The engine's rounds read ε from the
    memoized accounting (computed once per configuration, timed separately as ``accounting``); the
    project's ServerApp accounts inside its rounds. Medians, min–max and the ratio of medians to
    ``flower-dp`` are printed. Every system trains the same users (``synthetic.w1_user_data``) on the
    same model; Flower samples exactly 50 users per round, fed-dp's Poisson sampler 50 in expectation
    (the users trained are printed).
``scaling``
    The engine with cohorts of 50, 200 and 1,000 users per round (every user every round), against plain
    minibatch training over the same examples: the per-user overhead is (round − plain) / users.
``noise``
    Side by side at d = 10⁷: one step of independent noise, BandMF (b = 64) and BLT (2 … 5 buffers), each
    against drawing one N(0, I_d) vector (steps interleaved); the memory of each stream's state; the
    error each strategy optimizes at T = 2,000 (with min-separation 64, and with one participation); the
    time to read the BandMF ring once (its memory-bandwidth floor); cold strategy optimization times,
    up to T = 10,000 with b = 1,024.
``secure-noise``
    Drawing N(0, I_d) in float64, d = 10⁷, from the secure source (AES-256-CTR keyed from os.urandom) and from the
    seeded torch source against ``torch.randn`` in float32 on the same device (the CPU, and the GPU when there is
    one): the throughput ratios; and a whole release on the grid against a float32 draw added in float32.
``accounting``
    ε after 10,000 Poisson-sampled Gaussian rounds with PLD, the whole per-round ε schedule of those rounds
    (RDP and PLD), and calibrating σ for a target ε (PLD and RDP).
``deployment``
    A SuperLink and 10 SuperNodes on 127.0.0.1 as processes: the seconds of a round of Flower's floor (an echo
    app: one W1-sized array to every node and back) and of the project's apps with a trivial local step, without
    and with a node service beside each SuperNode, side by side (:func:`bench_deployment`).
``small-users``
    Many users with little data each, one torch thread (``benchmark.small_users``): seed 003's
    heavy-tail task with one example per user at G = 6, L = 256 and at the paper's G = 8, L = 1,024, the
    engine's rounds against a direct implementation of the same round (closed-form per-example gradients of
    the linear model), alternating, with the ratio of the medians and the peak memory; and a StackOverflow-
    shaped population of 342,477 lazily generated users, 1,000 per round: seconds per round, ms per user, peak
    memory. ``--small-users-rounds``, ``--small-users-paper-rounds`` (0 skips the paper's size) and
    ``--small-users-max-seconds`` size it.
``paths``
    Whether ``client.training = "auto"`` takes the fastest training path (``benchmark.paths``): small users of a
    linear model, the W1 CNN and a next-token model, with one and with several local steps, each run with auto,
    vectorized and sequential; the fastest round of each and auto over the fastest. ``--paths-rounds`` sizes it.
``finetune``
    Fine-tuning under user-level DP (``benchmark.finetune``, needs the hf part): GPT-2 models from 2 layers to
    GPT-2-small with LoRA r = 8, and a small one trained in full, private against non-private with the same users
    and seeds, alternating: the trainable count, seconds per user, their ratio, the training path, the peak memory
    and the bytes per user on the wire against the full model's. On CUDA when there is one, else the CPU with one
    torch thread. ``--finetune-rounds`` sizes it.
``gpu`` (only with CUDA)
    W1's data scaled to 10,000 users and 1,000 per round on ``cuda``, with W1's CNN and the seeds' CIFAR CNN:
    users/s of the engine's vectorized path against the hardware's practical limit for the same work (one
    model trained on the same examples in batches of a whole round's examples and of 1,024), the peak memory,
    and host-to-device copies and synchronizations per round from a profile (:func:`bench_gpu`).

Machines are shared and noisy: compare ratios measured in the same run, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fed_dp.simulations.benchmark.accounting import bench_accounting, format_accounting
from fed_dp.simulations.benchmark.arguments import SECTIONS, build_parser
from fed_dp.simulations.benchmark.deployment import bench_deployment, format_deployment
from fed_dp.simulations.benchmark.gpu import bench_gpu, format_gpu
from fed_dp.simulations.benchmark.noise import bench_noise, bench_secure_noise, format_noise, format_secure_noise
from fed_dp.simulations.benchmark.scaling import bench_scaling, format_scaling
from fed_dp.simulations.benchmark.w1 import W1Spec, bench_w1, format_w1

def plot(results: dict[str, Any], path: Path) -> Path | None:
    """W1 medians with min–max whiskers and the ratio to flower-dp; when measured, the cohort scaling."""
    if "w1" not in results and "scaling" not in results:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in ("w1", "scaling") if k in results]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, key in zip(axes[0], panels):
        if key == "w1":
            systems = results["w1"]["systems"]
            names = list(systems)
            med = [systems[n]["median"] for n in names]
            err = [[m - systems[n]["min"] for n, m in zip(names, med)], [systems[n]["max"] - m for n, m in zip(names, med)]]
            ax.barh(names, med, xerr=err, capsize=3,
                    color=["tab:gray" if n.startswith("flower") else "tab:blue" for n in names])
            for i, name in enumerate(names):
                speed = systems[name]["speedup_vs_flower_dp"]
                relative = "" if not speed or name == "flower-dp" else (
                    f"  ({speed:.1f}× faster)" if speed >= 1 else f"  ({1 / speed:.1f}× slower)")
                label = f" {med[i]:.1f} s{relative}"
                ax.text(systems[name]["max"], i, label, va="center", fontsize=8)
            ax.set_xlim(0, 1.45 * max(systems[n]["max"] for n in names))
            ax.set_xlabel("wall time of the W1 rounds (s)")
            ax.invert_yaxis()
            ax.set_title(f"W1, median of {systems[names[0]]['runs']} runs (min–max)")
        else:
            rows = results["scaling"]["rows"]
            ax.plot([r["cohort"] for r in rows], [r["round_seconds"] for r in rows], "o-", label="engine round")
            ax.plot([r["cohort"] for r in rows], [r["plain_seconds"] for r in rows], "s--", label="plain training")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("users per round")
            ax.set_ylabel("seconds")
            ax.legend()
            ax.set_title("cohort scaling")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(args: argparse.Namespace, log=print) -> dict[str, Any]:
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise ValueError(f"unknown benchmark section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    if not (isinstance(args.runs, int) and args.runs >= 1):
        raise ValueError(f"--runs must be >= 1, got {args.runs}")
    runs = 1 if args.smoke else args.runs
    spec = W1Spec.smoke() if args.smoke else W1Spec()
    out = Path(args.out) if args.out else Path("results") / f"benchmark-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "torch": torch.__version__,
                                           "torch_threads": torch.get_num_threads(),
                                           "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
                               "smoke": bool(args.smoke)}
    printed: list[str] = []

    def section(title: str, text: str) -> None:
        block = f"\n== {title} ==\n{text}"
        printed.append(block)
        log(block)

    if "w1" in sections:
        log("measuring W1 ...")
        with tempfile.TemporaryDirectory(prefix="fed-dp-bench-") as folder:
            results["w1"] = bench_w1(spec, runs, Path(folder), flower=not args.no_flower, timeout=args.timeout,
                                     smoke=args.smoke, settle=0.0 if args.smoke else 3.0, log=log)
        section("W1", format_w1(results["w1"]))
    if "scaling" in sections:
        log("measuring cohort scaling ...")
        cohorts, rounds = ((4, 8), 2) if args.smoke else ((50, 200, 1000), 3)
        results["scaling"] = bench_scaling(spec, cohorts, rounds, runs, log=log)
        section("cohort scaling (engine, every user every round; median round)", format_scaling(results["scaling"]))
    if "noise" in sections:
        log("measuring noise ...")
        dim, bands, horizon, buffers = (10_000, 8, 64, (2, 3)) if args.smoke else (10**7, 64, 2000, (2, 3, 4, 5))
        results["noise"] = bench_noise(dim, bands, horizon, buffers, steps=3 if args.smoke else 10, log=log)
        section("noise", format_noise(results["noise"]))
    if "secure-noise" in sections:
        log("measuring secure noise ...")
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        results["secure-noise"] = bench_secure_noise(10_000 if args.smoke else 10**7, 3 if args.smoke else 10, devices)
        section("noise sources (float64 draws) vs torch.randn", format_secure_noise(results["secure-noise"]))
    if "accounting" in sections:
        log("measuring accounting ...")
        results["accounting"] = bench_accounting(100, 1.0) if args.smoke else bench_accounting(10_000, 8.0)
        section("accounting", format_accounting(results["accounting"]))
    if "gpu" in sections:
        if torch.cuda.is_available():
            log("measuring on the GPU ...")
            users, cohort, rounds = (64, 16, 2) if args.smoke else (10_000, 1_000, 5)
            results["gpu"] = bench_gpu(spec, users, cohort, rounds, "cuda", log=log)
            section("GPU: the engine against the hardware's limit", format_gpu(results["gpu"]))
        else:
            results["gpu"] = None
            section("GPU", "no CUDA device on this machine: skipped")
    if "deployment" in sections:
        log("measuring deployment rounds ...")
        nodes, rounds = (1, 1) if args.smoke else (10, 6)
        with tempfile.TemporaryDirectory(prefix="fed-dp-deployment-") as folder:
            results["deployment"] = bench_deployment(nodes, rounds, Path(folder), log=log)
        section("deployment rounds", format_deployment(results["deployment"]))
    if "small-users" in sections:
        from fed_dp.simulations.benchmark import small_users as benchmark_small_users

        log("measuring many small users ...")
        results["small-users"] = benchmark_small_users.run_section(args, log=log)
        section("many small users: the engine against a direct implementation of the same round",
                benchmark_small_users.format_small_users(results["small-users"]))
    if "paths" in sections:
        from fed_dp.simulations.benchmark import paths as benchmark_paths

        log("measuring the training paths ...")
        results["paths"] = benchmark_paths.bench_paths(benchmark_paths.workloads(smoke=bool(args.smoke)),
                                                       rounds=2 if args.smoke else args.paths_rounds, log=log)
        section("training paths: the automatic choice against each path (CPU, one torch thread)",
                benchmark_paths.format_paths(results["paths"]))
    if "finetune" in sections:
        from fed_dp.simulations.benchmark import finetune as benchmark_finetune

        log("measuring fine-tuning ...")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        results["finetune"] = benchmark_finetune.bench_finetune(
            benchmark_finetune.workloads(smoke=bool(args.smoke)), rounds=2 if args.smoke else args.finetune_rounds,
            device=device, log=log)
        section(f"fine-tuning: private against non-private, the same users ({device})",
                benchmark_finetune.format_finetune(results["finetune"]))
    (out / "benchmark.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "benchmark.txt").write_text("\n".join(printed) + "\n")
    figure = plot(results, out / "benchmark.png")
    log(f"\nresults: {out / 'benchmark.json'}, {out / 'benchmark.txt'}" + (f", {figure}" if figure else ""))
    return results


def main(argv: list[str] | None = None) -> int:
    run(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
