"""A measurement, not a test (issue 40 item 7): tries of an N-SuperNode deployment on 127.0.0.1, each a fresh
SuperLink (with ``--database``) and N SuperNodes (insecure, the built-in task's 40 users split evenly) running one
run; prints each try's status, wall time and how often the SuperLink's state store said "database is locked".

    PATH=$PWD/.venv/bin:$PATH python tests/server/deployment_tries.py /tmp/tries --nodes 12 --tries 3 \
        --reply-timeout 30
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from fed_dp.simulations.launch.local_deployment import deployment


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("--nodes", type=int, default=12)
    parser.add_argument("--tries", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reply-timeout", type=float, default=30.0)
    parser.add_argument("--task", default="heavy-tail")
    args = parser.parse_args()
    users = 40
    bounds = [round(k * users / args.nodes) for k in range(args.nodes + 1)]
    results = []
    for attempt in range(args.tries):
        folder = args.folder / f"try{attempt}"
        started = time.monotonic()
        with deployment(folder, None) as d:
            d.start_superlink()
            nodes = [d.start_supernode({"users": f"{bounds[k]}-{bounds[k + 1] - 1}", "name": f"node{k}"})
                     for k in range(args.nodes)]
            d.wait_for_nodes(nodes, timeout=300)
            up = time.monotonic() - started
            outcome = d.run({"task.ref": args.task, "privacy.rounds": args.rounds, "privacy.accountant": "rdp",
                             "server.checkpoint-dir": str(folder / "ckpt"), "server.min-nodes": args.nodes,
                             "server.reply-timeout": args.reply_timeout, "client.device": "cpu", "run.seed": 1},
                            timeout=1800)
            wall = time.monotonic() - started
            superlink = "".join(p.output() for p in d.superlinks)
            locked = len(re.findall(r"database is locked", superlink))
            errors = len(re.findall(r"UnexpectedError", superlink))
            log = outcome.output
            retries = len(re.findall(r"the SuperLink failed .*; retry \d+ of", log))
            tail = "\n".join(log.splitlines()[-15:]) if outcome.status != "finished:completed" else ""
        result = {"try": attempt, "status": outcome.status, "wall_s": round(wall, 1), "nodes_up_s": round(up, 1),
                  "superlink_db_locked": locked, "superlink_unexpected_errors": errors, "serverapp_retries": retries}
        results.append(result)
        print(json.dumps(result), flush=True)
        if tail:
            print(tail, flush=True)
    done = sum(r["status"] == "finished:completed" for r in results)
    print(f"{done} of {len(results)} tries completed", flush=True)
    return 0 if done == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
