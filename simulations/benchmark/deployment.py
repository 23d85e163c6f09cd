"""The ``deployment`` section of ``fed-dp benchmark``: the seconds of a deployment round on 127.0.0.1, Flower's
floor (an echo app) against the project's apps, without and with node services."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

from fed_dp.checkpoint import read_diagnostics
from fed_dp.simulations.benchmark.measure import table


def bench_deployment(nodes: int, rounds: int, folder: Path, log=print) -> dict[str, Any]:
    """A deployment round's overhead on 127.0.0.1, ``rounds`` rounds of each system, ``nodes`` SuperNodes of 4
    users each (insecure: no TLS, which a real deployment needs), as processes:

    - Flower's floor (``benchmark.flower_echo``: one W1-sized array to every node and back), then the project's
      apps, on one SuperLink and the same SuperNodes;
    - the project's apps again on a second SuperLink whose SuperNodes each have a node service beside them
      (``fed_dp.clients.node_service``: the task and model stay loaded across messages).

    The project's runs use the W1 task and model (the same array size as the echo) with every user sampled and
    one local step on one example (``privacy.sampler = "all"``, ``local.steps = 1``, ``local.max-examples = 1``).
    Medians of the rounds after the first (the first also installs the app bundle on every node)."""
    from fed_dp.simulations.benchmark.flower_echo import APP
    from fed_dp.simulations.launch.local_deployment import deployment

    def start(d, service: bool) -> None:
        d.start_superlink()
        started = [d.start_supernode({"users": f"{k * 4}-{k * 4 + 3}"}, service=service) for k in range(nodes)]
        d.wait_for_nodes(started, timeout=120)

    def fed_dp_rounds(d, checkpoint: Path) -> list[float]:
        outcome = d.run({"task.ref": "w1", "task.users": nodes * 4, "task.examples": 2, "privacy.sampler": "all",
                         "privacy.expected-cohort": nodes * 4, "privacy.rounds": rounds, "privacy.accountant": "rdp",
                         "local.steps": 1, "local.batch-size": 1, "local.max-examples": 1, "run.eval-every": 0,
                         "run.seed": 1, "server.checkpoint-dir": str(checkpoint), "server.min-nodes": nodes,
                         "client.device": "cpu"}, timeout=60 + 120 * rounds)
        if outcome.status != "finished:completed":
            raise RuntimeError(f"the project's apps did not complete ({outcome.status}):\n{d.diagnostics()}")
        return [r["round_seconds"] for r in read_diagnostics(checkpoint)]  # the operator's: it tracks the cohort

    with deployment(folder / "plain", None) as d:
        start(d, service=False)
        echo_out = folder / "echo.json"
        echo = d.finish(d.submit({"rounds": rounds, "out": str(echo_out)}, app=APP), timeout=60 + 120 * rounds)
        if echo.status != "finished:completed" or not echo_out.exists():
            raise RuntimeError(f"Flower's echo app did not complete ({echo.status}):\n{d.diagnostics()}")
        times = {"echo": json.loads(echo_out.read_text())["round_seconds"]}
        log(f"  flower echo:          rounds {', '.join(f'{x:.1f}' for x in times['echo'])} s")
        times["fed_dp"] = fed_dp_rounds(d, folder / "fed-dp")
        log(f"  fed-dp:               rounds {', '.join(f'{x:.1f}' for x in times['fed_dp'])} s")
    with deployment(folder / "service", None) as d:
        start(d, service=True)
        times["fed_dp_service"] = fed_dp_rounds(d, folder / "fed-dp-service")
        log(f"  fed-dp, node service: rounds {', '.join(f'{x:.1f}' for x in times['fed_dp_service'])} s")
    medians = {name: statistics.median(t[1:] or t) for name, t in times.items()}
    return {"nodes": nodes, "rounds": rounds, "cores": len(os.sched_getaffinity(0)),
            **{f"{name}_round_seconds": t for name, t in times.items()},
            **{f"{name}_median": m for name, m in medians.items()},
            "ratio_to_echo": medians["fed_dp"] / medians["echo"],
            "service_ratio_to_echo": medians["fed_dp_service"] / medians["echo"]}


def format_deployment(r: dict[str, Any]) -> str:
    rows = [["Flower's floor: echo of one W1-sized array", f"{r['echo_median']:.2f}", "1"],
            ["fed-dp's apps: W1, every user, one local step", f"{r['fed_dp_median']:.2f}", f"{r['ratio_to_echo']:.2f}×"],
            ["the same, a node service beside each SuperNode", f"{r['fed_dp_service_median']:.2f}",
             f"{r['service_ratio_to_echo']:.2f}×"]]
    met = min(r["fed_dp_median"], r["fed_dp_service_median"]) <= 1
    which = f"median of rounds 2..{r['rounds']}" if r["rounds"] > 1 else "one round"
    return (f"{r['nodes']} SuperNode(s) on 127.0.0.1, {r['cores']} cores, {which}; a target of "
            f"1 s per round {'is' if met else 'is not'} met\n"
            + table(["system", "round s", "vs Flower's floor"], rows))
