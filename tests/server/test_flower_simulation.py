"""The project's ServerApp and ClientApp under Flower's simulation engine (`flwr run .`), never mocked."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
import torch

import flower_run
from fed_dp.accounting import epsilon, resolve_privacy
from fed_dp.checkpoint import COMMIT_NAME, load_checkpoint, read_diagnostics
from fed_dp.clients.task import build_task
from fed_dp.config import LocalTraining
from fed_dp.run_config import RunConfig
from fed_dp.simulations.engine.inprocess import train

RUN = {"run.seed": 7, "privacy.rounds": 3, "task.users": 40}


def _privacy(config: dict):
    """The PrivacyConfig the ServerApp runs for ``config`` (N = the task's 40 users), built here."""
    return resolve_privacy(RunConfig.from_flat(config).privacy, 40)


def _results(folder) -> list[dict]:
    return json.loads((folder / "results.json").read_text())


def test_two_nodes_hosting_20_users_each_train_with_poisson_sampling(tmp_path):
    """Multi-user nodes: 2 SuperNodes × 20 users, Poisson user sampling by the fed_dp sampler.

    Checks: ε every round = dp_accounting's for the config; every sampled user replied; the final model
    equals the in-process engine's for the same seeds (tolerance 1e-5: only the order in which float32
    sums are added differs, per node first here).
    """
    out = tmp_path / "ckpt"
    config = {**RUN, "server.checkpoint-dir": str(out)}
    log = flower_run.run(tmp_path / "home", config, supernodes=2)
    assert "2 SuperNode(s) host 40 of the 40 users" in log, log[-3000:]
    records = _results(out)
    run = RunConfig.from_flat(config)
    privacy = _privacy(config)
    assert privacy.sampler == "poisson" and privacy.num_users == 40 and privacy.accountant == "pld"
    assert [r["round"] for r in records] == [0, 1, 2, 3]  # 0: the initial model's evaluation (Flower's evaluate(0))
    assert records[0]["epsilon"] == 0.0
    for record in records[1:]:
        assert record["epsilon"] == pytest.approx(epsilon(privacy, record["round"]), rel=1e-12)
        assert not {"cohort_size", "replied_users", "dropped"} & set(record)  # published: no counts
    for counts in read_diagnostics(out):  # the operator's secret diagnostics
        assert counts["replied_users"] == counts["cohort_size"] and not counts["dropped"]
    for record in records[1:]:  # every released round's ε is logged (round 0 released nothing)
        assert f"round {record['round']}/3: epsilon {record['epsilon']:.4f}" in log
    flower_params = load_checkpoint(out)["state"]["params"]

    task = build_task(run.task)
    engine = train(task, privacy, run.optimizer.build(), run.local, seed=7, device="cpu")
    torch.manual_seed(7)
    initial = torch.cat([p.detach().reshape(-1) for p in task.build_model().parameters()])
    assert not torch.allclose(flower_params, initial)
    torch.testing.assert_close(flower_params, engine.params, rtol=1e-5, atol=1e-6)


def test_w1_through_flower_equals_the_fast_engine_with_the_same_seeds(tmp_path):
    """A tiny W1 (conv model, channels-last, DP-FedAvg) through `flwr run` and through the in-process fast
    engine, both of its paths, with the same seeds: the same ε every round (exactly) and the same final
    model, with the users assigned to 8 virtual SuperNodes after asking a few of them. Tolerances: the sequential
    path (what the ClientApp runs on the CPU) adds the same float32 numbers in a different order across nodes:
    rtol 1e-5, atol 1e-6; the vectorized path also uses
    grouped convolutions, which round differently: rtol 1e-4, atol 1e-5."""
    out = tmp_path / "ckpt"
    config = {"task.ref": "w1", "task.users": 8, "task.examples": 8, "privacy.expected-cohort": 4,
              "privacy.rounds": 2, "privacy.accountant": "rdp", "optimizer.name": "dp-fedavg", "optimizer.lr": 1.0,
              "local.batch-size": 4, "local.lr": 0.05, "run.seed": 11, "run.eval-every": 0,
              "server.checkpoint-dir": str(out)}
    log = flower_run.run(tmp_path / "home", config, supernodes=8)  # one virtual SuperNode per user, as W1's
    # with fewer cores than nodes, only a core's worth of nodes is asked which users they host (membership.py)
    assert "the 8 users assigned to its 8 virtual SuperNodes" in log and "8 SuperNode(s) host 8 of the 8" in log, log[-3000:]
    records = _results(out)
    privacy = resolve_privacy(RunConfig.from_flat(config).privacy, 8)
    assert [r["epsilon"] for r in records] == [epsilon(privacy, t) for t in (1, 2)]
    flower_params = load_checkpoint(out)["state"]["params"]
    task = build_task(RunConfig.from_flat(config).task)
    local = LocalTraining(epochs=1, batch_size=4, lr=0.05)
    for path, tolerance in (("auto", {"rtol": 1e-5, "atol": 1e-6}), ("vectorized", {"rtol": 1e-4, "atol": 1e-5})):
        engine = train(task, privacy, "dp-fedavg", local, seed=11, training=path, device="cpu",
                       eval_every=0)  # as the Flower run (run.eval-every = 0): no round-0 evaluation record
        assert [r["nonprivate_cohort_size"] for r in engine.records] == [c["cohort_size"] for c in read_diagnostics(out)]
        assert [r["epsilon"] for r in engine.records] == [r["epsilon"] for r in records]
        torch.testing.assert_close(flower_params, engine.params, **tolerance)
    torch.manual_seed(11)
    initial = torch.cat([p.detach().reshape(-1) for p in task.build_model().parameters()])
    assert (flower_params - initial).norm() > 1e-3  # training and noise moved the model


def test_frozen_parameters_stay_on_the_nodes_and_the_run_equals_the_fast_engine(tmp_path):
    """Issue 38: a model with frozen parameters (requires_grad=False, initialized from run.seed on every process)
    through `flwr run`: the checkpoint holds the trainable part only, the nodes trained with the server's frozen
    part (the final model equals the in-process engine's, whose frozen part is bit-identical to the initial model's,
    tests/clients/test_frozen.py) and the server's evaluation used it too (the same final metrics)."""
    from frozen_task import REFERENCE, frozen_task

    out = tmp_path / "ckpt"
    config = {"task.ref": REFERENCE, "privacy.expected-cohort": 6, "privacy.rounds": 2, "privacy.accountant": "rdp",
              "local.batch-size": 2, "run.seed": 4, "server.checkpoint-dir": str(out)}
    here = str(flower_run.REPO / "tests" / "server")
    log = flower_run.run(tmp_path / "home", config, supernodes=2,
                         environment={"PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))})
    assert "2 SuperNode(s) host 24 of the 24 users" in log, log[-3000:]
    run = RunConfig.from_flat(config)
    engine = train(frozen_task(), resolve_privacy(run.privacy, 24), run.optimizer.build(), run.local, seed=4, device="cpu")
    flower_params = load_checkpoint(out)["state"]["params"]
    assert flower_params.shape == engine.params.shape == (10 * 16 + 3 * 16 + 3,)
    torch.testing.assert_close(flower_params, engine.params, rtol=1e-5, atol=1e-6)
    final = _results(out)[-1]
    assert final["round"] == 2
    assert final["eval_loss"] == pytest.approx(engine.records[-1]["eval_loss"], rel=1e-5)


def test_kill_and_resume_reaches_the_same_model_with_a_continued_ledger(tmp_path):
    rounds = 60  # rounds take ~0.1 s once warm: enough of them to stop the run in the middle
    base = {**RUN, "privacy.rounds": rounds, "privacy.accountant": "rdp", "run.eval-every": 0}
    interrupted, straight = tmp_path / "interrupted", tmp_path / "straight"
    home = tmp_path / "home-a"
    process = flower_run.start(home, {**base, "server.checkpoint-dir": str(interrupted)}, supernodes=2)
    try:
        def two_rounds_saved() -> bool:
            payload = (interrupted / COMMIT_NAME).exists() and load_checkpoint(interrupted)
            return bool(payload) and payload["state"]["round"] >= 2

        flower_run.wait_for(two_rounds_saved, 180, "two checkpointed rounds")
    finally:
        flower_run.stop_local_superlink(home)  # the server dies mid-run
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    killed_at = load_checkpoint(interrupted)["state"]["round"]
    assert 2 <= killed_at < rounds, "the kill must happen mid-run"

    log = flower_run.run(tmp_path / "home-b", {**base, "server.checkpoint-dir": str(interrupted)}, supernodes=2)
    assert f"resumed from {interrupted} at round {killed_at}" in log
    flower_run.run(tmp_path / "home-c", {**base, "server.checkpoint-dir": str(straight)}, supernodes=2)

    resumed, uninterrupted = load_checkpoint(interrupted)["state"], load_checkpoint(straight)["state"]
    assert torch.equal(resumed["params"], uninterrupted["params"])
    assert resumed["ledger"] == uninterrupted["ledger"] and len(resumed["ledger"]["records"]) == rounds
    assert [r["epsilon"] for r in _results(interrupted)] == [r["epsilon"] for r in _results(straight)]


def test_the_readme_flwr_run_command_works_and_prints_epsilon(tmp_path):
    """`flwr run .` exactly as the docs show it (docs/how-to/flower-app.md; out of the box: built-in synthetic
    task, default config)."""
    import re
    import subprocess

    page = (flower_run.REPO / "docs" / "how-to" / "flower-app.md").read_text()
    section = page[page.index("## Running with Flower"):]
    command = re.search(r"```bash\n(FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 flwr run \. --stream[^\n]*)\n```", section).group(1)
    home = tmp_path / "home"
    try:
        done = subprocess.run(["bash", "-c", command], cwd=flower_run.REPO, env=flower_run.flwr_env(home),
                              capture_output=True, text=True, timeout=240)
    finally:
        flower_run.stop_local_superlink(home)
    output = done.stdout + done.stderr
    assert done.returncode == 0
    expected = epsilon(_privacy({}), 5)  # the defaults: 40 users, B = 10, σ = 1, δ = 1e-5, PLD
    assert re.search(rf"round 5/5: epsilon {expected:.4f}, delta 1e-05", output), output[-3000:]
    assert f"fed-dp finished: 5 rounds, user-level epsilon {expected:.4f}" in output
    assert f"epsilon {expected:.4f}" in section  # the docs show what the command prints


def test_a_round_over_the_epsilon_budget_is_refused_and_the_run_ends_cleanly(tmp_path):
    out = tmp_path / "ckpt"
    config = {**RUN, "privacy.rounds": 5, "privacy.epsilon-budget": 3.5, "server.checkpoint-dir": str(out)}
    privacy = _privacy(config)
    allowed = max(t for t in range(1, 6) if epsilon(privacy, t) <= 3.5)
    assert allowed < 5  # the budget really binds
    log = flower_run.run(tmp_path / "home", config, supernodes=2)
    assert f"fed-dp stopped before round {allowed + 1}" in log and "above the budget" in log
    records = _results(out)
    assert [r["round"] for r in records] == list(range(allowed + 1)) and records[-1]["epsilon"] <= 3.5
    assert load_checkpoint(out)["state"]["round"] == allowed


def test_adaptive_clipping_bits_travel_through_flower(tmp_path):
    """Clients reply their clip-bit sums; the server moves ζ from them; ε stays that of the config's σ."""
    out = tmp_path / "ckpt"
    config = {**RUN, "adaptive.enabled": True, "adaptive.bit-noise-std": 2.0, "server.checkpoint-dir": str(out)}
    flower_run.run(tmp_path / "home", config, supernodes=2)
    records = _results(out)
    privacy = _privacy(config)
    counts = read_diagnostics(out)
    assert [r["round"] for r in records] == [0, 1, 2, 3] and all(c["replied_users"] == c["cohort_size"] for c in counts)
    released = records[1:]  # records[0]: the initial model's evaluation, before any clip norm is used
    assert released[0]["clip_norm"] == privacy.clip_norm
    assert [r["clip_norm"] for r in released[1:]] == [r["next_clip_norm"] for r in released[:-1]]
    assert all(0 <= c["unclipped_users"] <= c["replied_users"] for c in counts)
    assert records[-1]["epsilon"] == pytest.approx(epsilon(privacy, 3))


def test_a_text_task_from_local_files_runs_through_flower(tmp_path):
    """Penn Treebank (ptb.*.txt in a local folder, task.root) through `flwr run`: each process reads the files
    and builds the same vocabulary and users; ε is dp_accounting's and the final model the in-process
    engine's for the same seeds."""
    data = tmp_path / "ptb"
    data.mkdir()
    lines = [" the cat sat on the mat ", " a dog ran in the park N times ", " the <unk> was big and the cat ran ",
             " we sat in the park ", " N dogs and N cats "]
    for split in ("train", "valid", "test"):
        (data / f"ptb.{split}.txt").write_text("\n".join(lines) + "\n")
    out = tmp_path / "ckpt"
    config = {"task.ref": "ptb", "task.root": str(data), "task.users": 4, "task.length": 6,
              "privacy.expected-cohort": 2, "privacy.rounds": 2, "privacy.accountant": "rdp", "run.seed": 3,
              "local.batch-size": 2, "server.checkpoint-dir": str(out)}
    log = flower_run.run(tmp_path / "home", config, supernodes=2)
    assert "2 SuperNode(s) host 4 of the 4 users" in log, log[-3000:]
    records = _results(out)
    run = RunConfig.from_flat(config)
    privacy = resolve_privacy(run.privacy, 4)
    assert [r["round"] for r in records] == [0, 1, 2]  # 0: the initial model's evaluation
    assert [r["epsilon"] for r in records[1:]] == [epsilon(privacy, t) for t in (1, 2)]
    assert "eval_perplexity" in records[0] and "eval_perplexity" in records[-1]
    engine = train(build_task(run.task), privacy, run.optimizer.build(), run.local, seed=3, device="cpu")
    torch.testing.assert_close(load_checkpoint(out)["state"]["params"], engine.params, rtol=1e-5, atol=1e-6)
