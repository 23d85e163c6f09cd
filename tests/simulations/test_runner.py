"""Runner and CLI: configs, overrides, results files, table, plots — on a tiny heavy-tail config."""

from __future__ import annotations

import json

import pytest
import torch

from fed_dp.accounting import epsilon, resolve_privacy
from fed_dp.simulations.cli import main
from fed_dp.simulations.experiments.runner import apply_overrides, format_table, load_config, parse_experiment, read_results, run_experiment

TINY = [
    "task.groups=2", "task.largest=8", "task.users=16", "task.held-out=4",
    "privacy.expected-cohort=4", "privacy.rounds=3", "run.eval-every=1",
    'run.optimizers=["dp-sgd","dp-adambc"]',
]


def _tiny(extra=()) -> dict:
    return apply_overrides(load_config(None), TINY + list(extra))


def _privacy(config: dict, num_users: int = 16):
    return resolve_privacy(parse_experiment(config).privacy, num_users)


def test_default_config_is_the_main_job():
    """Issue 14's main job: >= 10,000 users, a meaningful ε (<= 8) at δ <= 1/N, DP-FedAvg/DP-SGDM, DP-Adam,
    DP-AdamBC and scale-then-privatize compared."""
    config = load_config(None)
    assert config["task"]["ref"] == "heavy-tail-mixture" and config["task"]["users"] >= 10_000
    assert {"dp-sgdm", "dp-adam", "dp-adambc", "dp-adam-stp"} <= set(config["run"]["optimizers"])
    experiment = parse_experiment(config)
    assert experiment.privacy.target_epsilon <= 8 and experiment.privacy.delta <= 1 / config["task"]["users"]
    assert epsilon(_privacy(config, config["task"]["users"])) <= experiment.privacy.target_epsilon  # σ meets it


def test_overrides_parse_toml_values_and_reject_unknown_tables():
    config = apply_overrides(load_config(None), ["privacy.rounds=7", 'privacy.sampler="all"', "local.lr=0.5"])
    assert config["privacy"]["rounds"] == 7 and config["privacy"]["sampler"] == "all" and config["local"]["lr"] == 0.5
    with pytest.raises(ValueError, match="unknown table"):
        apply_overrides(config, ["model.width=3"])
    with pytest.raises(ValueError, match="table.key=value"):
        apply_overrides(config, ["rounds=3"])


@pytest.mark.parametrize(
    "extra, message",
    [
        (["privacy.noise-multiplier=1.0"], "both set"),
        (['run.optimizers=["dp-lion"]'], "unknown optimizer"),
        (["optimizers.dp-sgd.lr=-1.0"], "lr"),
        (["run.colour=1"], "unknown key.*run.colour"),
        (['client.training="fast"'], "client.training"),
        (["client.chunk-size=-2"], "chunk-size"),
        (['client.device="tpu"'], "device"),
        (['privacy.rounds="many"'], "privacy.rounds must be int"),
        (['optimizer.name="dp-sgd"'], "optimizer.name or run.optimizers"),
        (["adaptive.target-quantile=0.9"], "adaptive.enabled is false"),
    ]
    + ([] if torch.cuda.is_available() else [(['client.device="cuda"'], "no CUDA device")]),
)
def test_invalid_configs_fail_before_training(extra, message):
    config = _tiny(extra)
    with pytest.raises(ValueError, match=message):
        parse_experiment(config)


def test_population_given_in_the_config_must_be_the_tasks(tmp_path):
    with pytest.raises(ValueError, match="task has 16 users"):
        run_experiment(_tiny(["privacy.num-users=5"]), tmp_path, progress=False, log=lambda *_: None)


def test_client_table_chooses_the_training_path_device_and_chunks():
    client = parse_experiment(_tiny(['client.training="vectorized"', 'client.device="cpu"', "client.chunk-size=4"])).base.client
    assert (client.vectorized, client.device, client.chunk_size) == (True, "cpu", 4)
    config = _tiny()
    config.pop("client", None)  # the schema's defaults
    default = parse_experiment(config).base.client
    assert (default.vectorized, default.device, default.chunk_size) == (None, "auto", None)
    assert parse_experiment(_tiny(['client.training="sequential"'])).base.client.vectorized is False


def test_run_experiment_writes_records_with_fed_dp_epsilon(tmp_path):
    config = _tiny()
    rows = run_experiment(config, tmp_path, progress=False, log=lambda *_: None)
    assert [r["optimizer"] for r in rows] == ["dp-sgd", "dp-adambc"]
    results = read_results(tmp_path)
    privacy = _privacy(config)
    for name, records in results.items():
        assert [r["round"] for r in records] == [0, 1, 2, 3]  # 0: the initial model's evaluation
        for record in records[1:]:
            assert record["epsilon"] == pytest.approx(epsilon(privacy, record["round"]))
            assert {"group0_accuracy", "group1_accuracy", "eval_loss", "nonprivate_train_loss"} <= set(record)
    assert "nu_hat_median" in results["dp-adambc"][-1]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary[0]["epsilon"] == pytest.approx(epsilon(privacy))
    assert json.loads((tmp_path / "config.json").read_text())["resolved"]["num_users"] == 16
    table = format_table(rows)
    assert "dp-adambc" in table and "group1" in table


def test_noiseless_baseline_is_reported_not_private(tmp_path):
    rows = run_experiment(_tiny(['run.optimizers=["noiseless-adam"]']), tmp_path, progress=False, log=lambda *_: None)
    assert rows[0]["epsilon"] == "not private"
    assert "not private" in format_table(rows)


def test_cli_simulate_and_plot_write_table_results_and_pngs(tmp_path, capsys):
    out = tmp_path / "run"
    sets = [arg for item in TINY for arg in ("--set", item)]
    assert main(["simulate", *sets, "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "optimizer" in printed and "dp-adambc" in printed
    for name in ("metrics.png", "groups.png", "groups_epsilon.png", "second_moment.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    figures = tmp_path / "figs"
    assert main(["plot", str(out), "--out", str(figures)]) == 0
    assert (figures / "metrics.png").exists()


def test_cli_compare_takes_the_optimizer_list(tmp_path, capsys):
    sets = [arg for item in TINY for arg in ("--set", item)]
    assert main(["compare", *sets, "--optimizers", "dp-sgdm,dp-adam", "--out", str(tmp_path), "--quiet", "--no-plot"]) == 0
    assert sorted(read_results(tmp_path)) == ["dp-adam", "dp-sgdm"]


def test_cli_errors_are_clear(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", "no-such-config"])
    assert exit_.value.code == 2 and "built-in configs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plot", str(tmp_path)])
    assert "rounds-" in capsys.readouterr().err


def _builtin_configs() -> list[str]:
    from importlib import resources

    return sorted(p.name[:-5] for p in (resources.files("fed_dp.simulations") / "configs").iterdir() if p.name.endswith(".toml"))


@pytest.mark.parametrize("name", _builtin_configs())
def test_every_builtin_config_parses(name):
    experiment = parse_experiment(load_config(name))
    assert experiment.runs and experiment.privacy.rounds >= 1


SYNTHETIC = [n for n in _builtin_configs() if load_config(n)["task"]["ref"] in ("heavy-tail", "sparse-logreg-1d")]


@pytest.mark.parametrize("name", SYNTHETIC)
def test_synthetic_builtin_configs_train_a_few_rounds(name, tmp_path, monkeypatch):
    monkeypatch.setenv("FED_DP_CACHE_DIR", str(tmp_path / "cache"))
    config = load_config(name)
    rounds = max(2, config["privacy"].get("bands", 1))  # BandMF needs T >= b
    shrink = [f"privacy.rounds={rounds}", "run.eval-every=1"]
    if config["task"]["ref"] == "heavy-tail":
        every_user = config["privacy"].get("sampler") == "all"  # full batch: the cohort is the population
        shrink += ["task.groups=2", "task.largest=8", "task.users=16",
                   f"privacy.expected-cohort={16 if every_user else 2}"]
    else:
        shrink += ["task.num-examples=40", "task.users=40", "privacy.expected-cohort=4"]
    rows = run_experiment(apply_overrides(config, shrink), tmp_path, progress=False, log=lambda *_: None)
    assert len(rows) == len(config["run"]["optimizers"])


def test_adaptive_clipping_runs_through_the_runner(tmp_path):
    rows = run_experiment(_tiny(["adaptive.enabled=true", "adaptive.target-quantile=0.9", "adaptive.bit-noise-std=1.0"]), tmp_path,
                          progress=False, log=lambda *_: None)
    records = read_results(tmp_path)["dp-sgd"]
    assert records[0]["round"] == 0 and "clip_norm" not in records[0]  # the initial model: nothing released
    assert all("next_clip_norm" in r for r in records[1:]) and records[1]["clip_norm"] == 1.0
    assert rows[0]["epsilon"] == pytest.approx(epsilon(_privacy(_tiny())))


def test_blt_noise_runs_through_the_runner_with_calibration(tmp_path, monkeypatch):
    """fed-dp simulate with privacy.noise = "blt": σ calibrated for the target, ε of every round from the BLT's
    event, the strategy optimized once and cached."""
    monkeypatch.setenv("FED_DP_CACHE_DIR", str(tmp_path / "cache"))
    extra = ['privacy.noise="blt"', "privacy.buffers=2", 'privacy.sampler="min-sep"', "privacy.target-epsilon=4.0",
             "privacy.rounds=5"]
    rows = run_experiment(_tiny(extra), tmp_path / "out", progress=False, log=lambda *_: None)
    privacy = _privacy(_tiny(extra))
    assert privacy.noise == "blt" and privacy.noise_multiplier is not None
    records = read_results(tmp_path / "out")["dp-adambc"]
    assert [r["round"] for r in records] == [0, 1, 2, 3, 4, 5]  # 0: the initial model's evaluation
    assert [r["epsilon"] for r in records[1:]] == [epsilon(privacy, t) for t in range(1, 6)]  # ≤ 10 rounds: all exact
    assert rows[0]["epsilon"] == pytest.approx(epsilon(privacy)) and epsilon(privacy) <= 4.0
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["blt-v2-T5-k2-m4-prefix-sum.json"]


DATA_CONFIGS = [n for n in _builtin_configs() if load_config(n)["task"]["ref"] in
                ("snli", "qnli", "ptb", "e2e", "femnist", "shakespeare", "stackoverflow", "flair")]


@pytest.mark.parametrize("name", sorted({n.removesuffix("-paper") for n in DATA_CONFIGS}))
def test_every_data_task_has_a_cpu_sized_and_a_paper_sized_config(name):
    assert {name, f"{name}-paper"} <= set(DATA_CONFIGS)


@pytest.mark.parametrize("name", [n for n in DATA_CONFIGS if not n.endswith("-paper")])
def test_fed_dp_simulate_runs_each_data_config_end_to_end_on_a_fixture(name, tmp_path):
    """`fed-dp simulate --config NAME --set task.root=<fixture>`: the config's task on tiny files in the real
    format, shrunk to 2 rounds of one optimizer (the fixture has a handful of users)."""
    import data_fixtures

    config = load_config(name)
    root = data_fixtures.write(config["task"]["ref"], tmp_path / "data")
    shrink = [f"task.root={root}", "privacy.rounds=2", "privacy.expected-cohort=2", "run.eval-every=1",
              f'run.optimizers=["{config["run"]["optimizers"][-1]}"]']
    if "users" in config["task"]:
        shrink.append("task.users=3")
    sets = [arg for item in shrink for arg in ("--set", item)]
    assert main(["simulate", "--config", name, *sets, "--out", str(tmp_path / "out"), "--quiet", "--no-plot"]) == 0
    records = read_results(tmp_path / "out")[config["run"]["optimizers"][-1]]
    assert [r["round"] for r in records] == [0, 1, 2] and "eval_loss" in records[-1]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["resolved"]["num_users"] >= 2


def test_config_option_is_the_positional_config(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", "main-job", "--config", "ptb"])
    assert exit_.value.code == 2 and "two configs given" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["simulate", "--config", "no-such-config"])
    assert "built-in configs" in capsys.readouterr().err


def test_an_unseeded_run_publishes_no_seed_that_reproduces_its_noise_or_cohorts(tmp_path):
    """Issue 25 item 2: without run.seed, config.json holds only the seed of the model's initialization and local
    training; re-running with it as run.seed draws other cohorts and other noise (on main it reproduced both:
    the sampler and noise seeds were derived from the written seed). A seeded run writes the seed it was given."""
    single = ['run.optimizers=["dp-sgd"]', "run.eval-every=0", 'run.seed=""']  # "": unset
    run_experiment(_tiny(single), tmp_path / "a", progress=False, log=lambda *_: None)
    written = json.loads((tmp_path / "a" / "config.json").read_text())["resolved"]
    assert "written nowhere" in written["seed_note"]
    run_experiment(_tiny([*single, f"run.seed={written['seed']}"]), tmp_path / "b", progress=False,
                   log=lambda *_: None)
    first, again = (read_results(tmp_path / run)["dp-sgd"] for run in ("a", "b"))
    assert all(x["update_norm"] != y["update_norm"] for x, y in zip(first, again))
    seeded = json.loads((tmp_path / "b" / "config.json").read_text())["resolved"]
    assert seeded["seed"] == written["seed"] and "sampler and noise are reproducible" in seeded["seed_note"]


def test_every_server_key_acts_in_fed_dp_simulate_or_is_refused(tmp_path):
    """Issue 25 item 6: on main fed-dp simulate accepted server.checkpoint-dir and wrote nothing. Now each optimizer
    checkpoints to (and resumes from) checkpoint-dir/<optimizer>; the keys only a Flower run acts on are refused
    with the reason."""
    folder = tmp_path / "ckpt"
    run_experiment(_tiny([f'server.checkpoint-dir="{folder}"']), tmp_path / "out", progress=False,
                   log=lambda *_: None)
    for name in ("dp-sgd", "dp-adambc"):
        assert json.loads((folder / name / "checkpoint.json").read_text())["round"] == 3
        assert [r["round"] for r in json.loads((folder / name / "results.json").read_text())] == [0, 1, 2, 3]
    for key in ("server.min-nodes=2", "server.reply-timeout=5.0", "server.node-wait=1.0"):
        with pytest.raises(ValueError, match=rf"{key.split('=')[0]} has no effect in fed-dp simulate: .*SuperNodes"):
            parse_experiment(_tiny([key]))


def test_an_experiment_resolves_its_privacy_once_for_all_its_optimizers(tmp_path, monkeypatch):
    """Issue 41: σ is calibrated once (the runner's resolve_privacy) and each optimizer's plan is run as built; the
    engine does not resolve it again."""
    import fed_dp.simulations.engine.inprocess as inprocess
    import fed_dp.simulations.experiments.runner as runner

    calls = []
    resolve = runner.resolve_privacy

    def counted(*args):
        calls.append(args)
        return resolve(*args)

    monkeypatch.setattr(runner, "resolve_privacy", counted)
    monkeypatch.setattr(inprocess, "resolve_privacy", counted)
    rows = run_experiment(_tiny(), tmp_path, progress=False, log=lambda *_: None)  # target-epsilon: σ calibrated
    assert [row["optimizer"] for row in rows] == ["dp-sgd", "dp-adambc"] and len(calls) == 1
