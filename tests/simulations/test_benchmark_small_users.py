"""The small-users section of the benchmark: its direct implementation computes the engine's round (the same
clipped sum, the same DP-AdamBC step), and a smoke run reports every workload with figures computed from its
measurements. Times are never asserted."""

from __future__ import annotations

import json

import pytest
import torch

from fed_dp.clients.node import LocalTrainer
from fed_dp.config import LocalTraining
from fed_dp.contribution import RoundPlan
from fed_dp.optimizers import RoundRelease, make_optimizer
from fed_dp.simulations.benchmark import small_users as small
from fed_dp.simulations.tasks.builtin import heavy_tail_task
from fed_dp.simulations.cli import main as cli_main


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("local_lr", "training"), [(1.0, "auto"), (0.3, "auto"), (1.0, "sequential")])
def test_direct_clipped_sum_equals_the_engines_contribution(local_lr, training, device):
    """Same users, same θ, same clip: the closed form (a ⊙ R)ᵀX equals LocalTrainer.contribution's Σu (the path
    the engine chooses, and the sequential one), with some users clipped and some not, on each device."""
    task = heavy_tail_task(groups=3, largest=8, users=24, seed=1)
    trainer = LocalTrainer(task, LocalTraining(steps=1, batch_size=64, lr=local_lr), device=device, training=training)
    theta = 0.3 * torch.randn(trainer.layout.size, generator=torch.Generator().manual_seed(0))
    theta = theta.to(device)
    direct = small.DirectLinearRound.of_task(task, small.HeavyTailWorkload(groups=3, largest=8, local_lr=local_lr,
                                                                           device=device))
    _, norms = small.linear_softmax_clipped_sum(theta.view(direct.shape), direct.x, direct.y, clip_norm=1.0,
                                                local_lr=local_lr)
    clip = float(norms.median())  # half of the users are clipped
    expected, norms = small.linear_softmax_clipped_sum(theta.view(direct.shape), direct.x, direct.y, clip_norm=clip,
                                                       local_lr=local_lr)
    assert bool((norms > clip).any()) and bool((norms < clip).any())
    plan = RoundPlan(round=0, cohort=torch.arange(task.num_users), params=theta, clip_norm=clip, scale=None,
                     send_squares=False)
    result, _, _ = trainer.contribution(plan, list(range(task.num_users)), seed=0)
    assert result.count == task.num_users
    torch.testing.assert_close(result.total.cpu(), expected.cpu(), rtol=1e-5, atol=1e-6)


def test_direct_adambc_steps_equal_the_engines_dp_adambc():
    optimizer = make_optimizer("dp-adambc", lr=0.003)
    generator = torch.Generator().manual_seed(0)
    params, phi = torch.zeros(50), 0.02
    state, direct = optimizer.init(params), small.AdamBCState.zeros(50)
    for _ in range(3):
        grad = 0.2 * torch.randn(50, generator=generator)
        step, state, _ = optimizer.update(RoundRelease(grad=grad, noise_variance=phi), state, params)
        direct_step, direct = small.adambc_update(direct, grad, phi, lr=optimizer.lr, beta1=optimizer.beta1,
                                                  beta2=optimizer.beta2)
        torch.testing.assert_close(direct_step, step)
        params = params + step


def test_workloads_are_the_issues_sizes_and_the_paper_size_can_be_skipped():
    a, c, b = small.workloads(smoke=False, rounds=5, paper_rounds=1)  # the largest last
    assert (a.users, a.groups, a.largest, a.rounds) == (1536, 6, 256, 5)
    assert (b.users, b.rounds) == (8192, 1)
    assert (c.users, c.cohort, c.vocabulary, c.rounds) == (342_477, 1000, 10_000, 5)
    for w in (a, b, c):
        assert (w.noise_multiplier, w.clip_norm, w.local_lr) == (10.0, 1.0, 1.0)
        assert w.local().steps == 1 and w.optimizer().bias_correction
    assert a.privacy().sampler == "all" and a.privacy().expected_cohort == 1536 and c.privacy().sampler == "poisson"
    assert [w.name for w in small.workloads(smoke=False, rounds=2, paper_rounds=0)] == ["A", "C"]
    assert {w.training for w in small.workloads(smoke=True, rounds=1, paper_rounds=1, training="sequential")} == {
        "sequential"}
    with pytest.raises(ValueError, match="training must be one of auto, sequential, vectorized"):
        small.HeavyTailWorkload(training="fast")
    with pytest.raises(ValueError, match="device must be one of cpu, cuda"):
        small.HeavyTailWorkload(device="tpu")
    assert {w.device for w in small.workloads(smoke=True, rounds=1, paper_rounds=1, device="cuda")} == {"cuda"}
    with pytest.raises(ValueError, match="paper_rounds must be an integer >= 0"):
        small.workloads(smoke=False, rounds=2, paper_rounds=-1)


@pytest.mark.parametrize(("option", "value", "message"), [
    ("--small-users-max-seconds", "0", "the wall-time cap in seconds must be a finite number > 0"),
    ("--small-users-paper-rounds", "-1", "the number of rounds must be an integer >= 0"),
    ("--small-users-rounds", "0", "the number of rounds must be an integer >= 1"),
])
def test_bad_section_options_are_refused_when_the_command_line_is_read(tmp_path, capsys, option, value, message):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["benchmark", "--only", "small-users", option, value, "--out", str(tmp_path)])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_the_wall_time_cap_ends_a_workload_after_its_first_round():
    result = small.measure(small.HeavyTailWorkload(groups=2, largest=2, rounds=3), max_seconds=1e-9,
                           log=lambda *_: None)
    assert result["rounds"] == 1 and result["rounds_planned"] == 3 and len(result["direct_round_seconds"]) == 1


def test_smoke_run_of_the_section(tmp_path):
    """`fed-dp benchmark --only small-users --smoke`: A and B against the direct implementation, C alone; the
    ratios, ms per user and peaks come from the measurements."""
    out = tmp_path / "bench"
    assert cli_main(["benchmark", "--only", "small-users", "--smoke", "--out", str(out)]) == 0
    section = json.loads((out / "benchmark.json").read_text())["small-users"]
    rows = {w["name"]: w for w in section["workloads"]}
    assert list(rows) == ["A", "C", "B"] and section["threads"] == 1
    for name in ("A", "B"):
        w = rows[name]
        assert w["users_per_round"] == [w["population"]] * w["rounds"]  # every user every round
        assert len(w["direct_round_seconds"]) == w["rounds"] == w["rounds_planned"]
        assert w["ratio_to_direct"] == pytest.approx(w["engine"]["median"] / w["direct"]["median"])
    assert {path for w in rows.values() for path in w["paths"]} == {"one-step"}  # the engine's own choice
    assert rows["C"]["direct"] is None and rows["C"]["population"] == 342_477 and rows["C"]["weights"] == 1_312
    for w in rows.values():
        assert w["ms_per_user"] == pytest.approx(1e3 * sum(w["engine_round_seconds"]) / sum(w["users_per_round"]))
        assert w["peak_resident_bytes"] >= w["resident_before_bytes"] > 0
        assert w["device"] == "cpu" and w["peak_gpu_bytes"] is None
    text = (out / "benchmark.txt").read_text()
    assert "engine/direct" in text and "StackOverflow-shaped" in text


@CUDA
def test_smoke_run_of_the_section_on_cuda(tmp_path):
    """`--small-users-device cuda`: every workload on the GPU, timed with the device synchronized, the GPU's
    peak allocation reported (positive: the model, data and moments live there)."""
    out = tmp_path / "bench"
    assert cli_main(["benchmark", "--only", "small-users", "--smoke", "--small-users-device", "cuda",
                     "--out", str(out)]) == 0
    rows = json.loads((out / "benchmark.json").read_text())["small-users"]["workloads"]
    for w in rows:
        assert w["device"] == "cuda" and w["peak_gpu_bytes"] > 0 and w["paths"] == ["one-step"]
        assert len(w["engine_round_seconds"]) == w["rounds"]
    assert "GPU peak GiB" in (out / "benchmark.txt").read_text()
