"""One simulation spread over several processes with ``torch.distributed``: ``torchrun ... fed_dp.train(...)``.

    torchrun --nproc_per_node 2 examples/distributed_simulation.py     # gloo on CPUs, NCCL on GPUs

Every process builds the same task and trainer; rank 0 runs the one round loop (sampler, noise, optimizer,
ledger, checkpoints, evaluation: ``fed_dp.round_loop.run_rounds``) and the others only train users.
Per round (:func:`exchange_round` on rank 0, :func:`serve_rounds` on the others):

    broadcast   header (round, cohort size, ζ_t, whether s_t and Σu² are used), cohort, θ_{t−1}, s_t
    train       rank r trains cohort[r :: world] exactly as one node of a Flower run would (same per-user seeds)
    reduce      Σu (and Σu²) and the counts to rank 0 with one sum-reduce each

so rank 0 receives one contribution: the sum of the clipped updates of the whole cohort, with its count. The
DP mechanism is untouched (``fed_dp.round.finish_round`` adds the noise and divides by the fixed B); only the
order of the float32 additions of Σu differs from one process, so a run equals the one-process run with the
same seed up to float rounding (``tests/simulations/test_distributed.py``). A worker's failure (a NaN loss, a
user's error) is reported to rank 0, which stops the run with an error naming the rank; the worker's own log has
the traceback. The header's first entry tells the workers to stop (at the end, or when rank 0 fails).
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NoReturn

import torch
import torch.distributed as dist

from fed_dp.clients.node import LocalTrainer
from fed_dp.contribution import Contribution, RoundPlan, UserTrainingError
from fed_dp.round_loop import RoundReplies

log = logging.getLogger(__name__)

_STOP, _ROUND = 0.0, 1.0
#: Σ over ranks of: users trained, users not clipped, loss·n, norm·n, users clipped, failed ranks, vectorized;
#: then the smallest user whose loading or training failed on any rank (∞: none)
_STATS = 8
_FAILED_USER = 7


@dataclass(frozen=True)
class Workers:
    """This process's place in the process group: ``rank`` of ``world`` processes; tensors travel on ``device``
    (the trainer's for NCCL, the CPU for gloo)."""

    rank: int
    world: int
    device: torch.device

    @property
    def leader(self) -> bool:
        return self.rank == 0


def current_workers() -> Workers | None:
    """The initialized process group, or None for a one-process run (no group, or a group of one)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    return Workers(dist.get_rank(), dist.get_world_size(), device)


def join_from_environment(device: str | torch.device) -> Workers | None:
    """Under ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) and with no process group yet, initialize one —
    NCCL when users train on CUDA (this process's GPU is ``LOCAL_RANK``), gloo otherwise; address, rank and world
    size come from torchrun's variables — and return this process's place. None for a one-process run. A group
    that is already initialized is used as it is (``fed_dp.train`` called from a script of your own)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        cuda = torch.device(device).type == "cuda"
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
    return current_workers()


def share_seed(workers: Workers, seed: int) -> int:
    """Rank 0's run seed on every rank: the model's initialization and the users' seeds derive from it."""
    box = [seed if workers.leader else None]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


def _train_share(workers: Workers, trainer: LocalTrainer, plan: RoundPlan,
                 seed: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """This rank's users of the plan's cohort: (Σu, Σu² or None, stats) on ``workers.device``; a failure becomes a
    failed-rank count."""
    users = plan.cohort[workers.rank::workers.world].tolist()
    total = torch.zeros_like(plan.params, device=workers.device)
    squares = torch.zeros_like(total) if plan.send_squares else None
    stats = torch.zeros(_STATS, dtype=torch.float64, device=workers.device)
    stats[_FAILED_USER] = math.inf  # reduced with MIN: the smallest failed user of any rank
    if not users:
        return total, squares, stats
    try:
        result, metrics, path = trainer.contribution(plan, users, seed=seed, source="simulation")
    except Exception as error:  # reported to rank 0 through the reduce; the traceback stays in this rank's log
        log.exception("rank %d: training users %s... failed in round %d", workers.rank, users[:5], plan.round + 1)
        stats[5] = 1.0
        if isinstance(error, UserTrainingError):
            stats[_FAILED_USER] = error.user
        return total, squares, stats
    n = result.count
    total = result.total.to(workers.device)
    squares = None if result.total_squares is None else result.total_squares.to(workers.device)
    stats.copy_(torch.tensor([n, n if result.unclipped is None else result.unclipped,
                              metrics["train_loss"] * n, metrics["mean_update_norm"] * n,
                              metrics["fraction_clipped"] * n, 0.0, float(path == "vectorized") * n, math.inf],
                             dtype=torch.float64))
    return total, squares, stats


def _reduce(total: torch.Tensor, squares: torch.Tensor | None, stats: torch.Tensor) -> None:
    """Sums to rank 0; the failed-user slot of ``stats`` by its minimum (every rank makes the same calls)."""
    failed_user = stats[_FAILED_USER:].clone()
    for tensor in (total, squares, stats):
        if tensor is not None:
            dist.reduce(tensor, dst=0, op=dist.ReduceOp.SUM)
    dist.reduce(failed_user, dst=0, op=dist.ReduceOp.MIN)
    stats[_FAILED_USER:] = failed_user


def exchange_round(workers: Workers, trainer: LocalTrainer, plan: RoundPlan, seed: int) -> RoundReplies:
    """Rank 0's side of one round: broadcast the plan, train its own share, receive the sums."""
    header = torch.tensor([_ROUND, plan.round, len(plan.cohort), plan.clip_norm, plan.scale is not None,
                           plan.send_squares], dtype=torch.float64, device=workers.device)
    dist.broadcast(header, src=0)
    cohort = plan.cohort.to(device=workers.device, dtype=torch.int64)
    params = plan.params.to(workers.device)
    dist.broadcast(cohort, src=0)
    dist.broadcast(params, src=0)
    scale = None
    if plan.scale is not None:
        scale = plan.scale.to(workers.device)
        dist.broadcast(scale, src=0)
    total, squares, stats = _train_share(workers, trainer, replace(plan, cohort=cohort.cpu(), params=params,
                                                                   scale=scale), seed)
    _reduce(total, squares, stats)
    n, unclipped, loss, norm, clipped, failed, vectorized, failed_user = stats.tolist()
    if failed:
        failure = RuntimeError(f"{int(failed)} of the {workers.world} ranks failed to train their users in round "
                               f"{plan.round + 1}; the traceback is in their logs")
        if math.isfinite(failed_user):  # a user's loading or training failed: the run stops with the model so far
            raise UserTrainingError(plan.round + 1, int(failed_user), trainer.user_id(int(failed_user)), failure)
        raise failure
    count = int(n)
    mean = (lambda x: x / count) if count else (lambda x: math.nan)
    result = Contribution(total.cpu(), count, None if squares is None else squares.cpu(), source="simulation",
                          unclipped=int(unclipped), scaled=plan.scale is not None)
    return RoundReplies([result], metrics={"processes": float(workers.world)},  # the ranks that trained the round
                        nonprivate={"train_loss": mean(loss), "mean_update_norm": mean(norm),
                                    "fraction_clipped": mean(clipped),  # the path, like the losses, needs users:
                                    "vectorized": float(count > 0 and vectorized == n)})  # an empty cohort shows


def leave_torchrun() -> NoReturn:
    """End a torchrun rank whose work is done and whose process group is destroyed: flush the output and exit at
    once, with status 0. An ordinary interpreter exit runs PyTorch's C++ teardown, which now and then aborts a
    finished gloo rank ("terminate called without an active exception", exit code -6; measured: 1 run in 12 of the
    2-process example here), and torchrun then reports the run as failed though every result was written. The last
    line of a script that torchrun launches (``fed-dp simulate`` ends so too)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def stop_workers(workers: Workers) -> None:
    """Tell the other ranks that no more rounds come (called by rank 0 when the loop ends, also on an error)."""
    dist.broadcast(torch.zeros(6, dtype=torch.float64, device=workers.device), src=0)


def serve_rounds(workers: Workers, trainer: LocalTrainer, params_like: torch.Tensor, seed: int,
                 on_round: Callable[[int], None] | None = None) -> int:
    """A worker's side: train this rank's share of every round rank 0 broadcasts, until told to stop; returns
    the number of rounds served."""
    served = 0
    while True:
        header = torch.empty(6, dtype=torch.float64, device=workers.device)
        dist.broadcast(header, src=0)
        kind, round_index, size, clip_norm, has_scale, send_squares = header.tolist()
        if kind == _STOP:
            return served
        cohort = torch.empty(int(size), dtype=torch.int64, device=workers.device)
        params = torch.empty_like(params_like, device=workers.device)
        dist.broadcast(cohort, src=0)
        dist.broadcast(params, src=0)
        scale = None
        if has_scale:
            scale = torch.empty_like(params)
            dist.broadcast(scale, src=0)
        plan = RoundPlan(round=int(round_index), cohort=cohort.cpu(), params=params, clip_norm=clip_norm, scale=scale,
                         send_squares=bool(send_squares))
        total, squares, stats = _train_share(workers, trainer, plan, seed)
        _reduce(total, squares, stats)
        served += 1
        if on_round is not None:
            on_round(served)
