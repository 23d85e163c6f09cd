"""The digits example spread over several processes: each trains a share of every round's cohort, rank 0 adds
the noise, steps the optimizer and accounts.   torchrun --nproc_per_node 2 examples/distributed_simulation.py
(gloo on CPUs; on GPUs NCCL, one GPU per process).  --out FILE: rank 0 saves the final model and records there."""

import argparse
import os

import torch
import torch.distributed as dist
from digits import make_task

import fed_dp
from fed_dp import LocalTraining, PrivacyConfig
from fed_dp.simulations.engine.distributed import leave_torchrun


def main(users: int = 100, rounds: int = 100, seed: int = 0, out: str | None = None) -> fed_dp.TrainResult:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")  # address, rank and world size from torchrun
    try:
        privacy = PrivacyConfig(expected_cohort=users // 2, rounds=rounds, target_epsilon=3.0, delta=1e-5)
        result = fed_dp.train(make_task(users, seed), privacy, fed_dp.make_optimizer("dp-adambc", lr=0.02),
                              LocalTraining(epochs=2, batch_size=8, lr=0.2), seed=seed, device="cuda" if cuda else "cpu")
        if dist.get_rank() == 0:
            print(f"{dist.get_world_size()} processes: user-level epsilon {result.epsilon:.3f}, "
                  f"test accuracy {result.records[-1]['eval_accuracy']:.3f}")
            if out:
                torch.save({"params": result.params, "records": result.records}, out)
        return result
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--users", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    args = parser.parse_args()
    main(args.users, args.rounds, args.seed, args.out)
    leave_torchrun()  # exit without PyTorch's C++ teardown, which now and then aborts a finished gloo rank
