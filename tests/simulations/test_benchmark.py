"""The benchmark: a smoke run of every section (Flower included), and the pieces it is built from.

Times are never asserted (machines are shared and noisy); what is checked is that every system ran the
workload it claims to, with the same privacy configuration, and that the figures are computed from
the measurements (medians, ratios, overheads).
"""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from fed_dp.accounting import epsilon
from fed_dp.run_config import RunConfig, flower_defaults
from fed_dp.simulations.benchmark import gpu, measure
from fed_dp.simulations.benchmark.command import SECTIONS
from fed_dp.simulations.benchmark.w1 import W1Spec
from fed_dp.simulations.cli import main as cli_main
from fed_dp.simulations.benchmark.flower_baseline import BaselineConfig


def test_summarize_is_median_min_max():
    assert measure.summarize([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0, "runs": 4}


def test_w1_spec_is_benchmarks_md_and_flower_runs_the_same_config():
    spec = W1Spec()
    assert (spec.users, spec.cohort, spec.rounds, spec.examples, spec.batch_size, spec.epochs) == (500, 50, 10, 32, 16, 1)
    assert (spec.lr, spec.clip_norm, spec.noise_multiplier) == (0.05, 1.0, 1.0)
    run_config = spec.run_config(checkpoint_dir="/tmp/x")
    assert set(run_config) - set(flower_defaults()) == {"task.users", "task.examples"}  # the rest are schema keys
    run = RunConfig.from_flat(run_config)
    assert run.privacy.replace(num_users=spec.users) == spec.privacy()
    assert run.optimizer.name == "dp-fedavg" and run.optimizer.options == {"lr": 1.0}
    assert run.local == spec.training() and run.task.target.endswith(":w1_task")
    baseline = spec.baseline("/tmp/out.json", client_cpus=2)
    assert isinstance(baseline, BaselineConfig)
    assert (baseline.users, baseline.cohort, baseline.rounds, baseline.lr, baseline.clip_norm,
            baseline.noise_multiplier) == (500, 50, 10, 0.05, 1.0, 1.0)


def test_unknown_section_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["benchmark", "--only", "w1,warp", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "unknown benchmark section(s) ['warp']" in capsys.readouterr().err


#: `fed-dp benchmark --smoke` in three parts, so that the parts needing Flower's simulation engine or real
#: deployment processes run with their test groups (tests/conftest.py) and the rest anywhere; together every section.
SMOKE_PARTS = {"w1": ("w1",), "deployment": ("deployment",),
               "rest": ("scaling", "noise", "secure-noise", "accounting", "gpu", "small-users", "paths"),
               "finetune": ("finetune",)}


def _smoke(tmp_path, part: str) -> tuple[dict, str]:
    """Run `fed-dp benchmark --smoke --only <part's sections>`; the saved JSON and text."""
    out = tmp_path / "bench"
    assert cli_main(["benchmark", "--smoke", "--only", ",".join(SMOKE_PARTS[part]), "--out", str(out)]) == 0
    return json.loads((out / "benchmark.json").read_text()), (out / "benchmark.txt").read_text()


def test_the_smoke_parts_cover_every_section_once():
    sections = [name for part in SMOKE_PARTS.values() for name in part]
    assert sorted(sections) == sorted(SECTIONS)


def test_smoke_run_measures_w1_side_by_side(tmp_path):
    """`fed-dp benchmark --smoke --only w1`: Flower's DP simulation, the project's Flower apps, the engine's paths
    and plain training on a tiny W1; saved JSON, text and figure."""
    results, text = _smoke(tmp_path, "w1")
    assert (tmp_path / "bench" / "benchmark.png").stat().st_size > 0 and "W1 system" in text

    w1 = results["w1"]
    spec = W1Spec(**w1["spec"])
    systems = w1["systems"]
    assert {"flower-dp", "flower-dp-flwr-run", "fed-dp-flower", "engine", "engine-1thread", "engine-vectorized",
            "plain"} <= set(systems)
    for flower in ("flower-dp", "flower-dp-flwr-run"):
        assert systems[flower]["users"] == spec.cohort * spec.rounds  # Flower samples exactly the cohort
        assert systems[flower]["total_seconds"]["median"] > systems[flower]["median"]  # the rounds are part of it
    engine_users = systems["engine"]["users"]
    assert systems["fed-dp-flower"]["users"] == engine_users == systems["plain"]["users"]  # the same Poisson cohorts
    assert systems["engine"]["path"] == "sequential" and systems["engine-vectorized"]["path"] == "vectorized"
    for entry in systems.values():
        assert entry["min"] <= entry["median"] <= entry["max"] and entry["runs"] == 1
        assert entry["speedup_vs_flower_dp"] == pytest.approx(systems["flower-dp"]["median"] / entry["median"])
    assert w1["epsilon"] == w1["flower_epsilon"] == epsilon(spec.privacy(), spec.rounds)


def test_smoke_run_measures_deployment_rounds(tmp_path):
    """`fed-dp benchmark --smoke --only deployment`: rounds on 1 real SuperNode of Flower's echo app and the
    project's apps."""
    results, text = _smoke(tmp_path, "deployment")
    deployment = results["deployment"]  # real SuperLink and SuperNode processes, Flower's echo app and the project's
    assert deployment["nodes"] == 1
    for name in ("echo", "fed_dp", "fed_dp_service"):
        assert len(deployment[f"{name}_round_seconds"]) == 1 and deployment[f"{name}_median"] > 0
    assert deployment["ratio_to_echo"] == pytest.approx(deployment["fed_dp_median"] / deployment["echo_median"])
    assert deployment["service_ratio_to_echo"] == pytest.approx(
        deployment["fed_dp_service_median"] / deployment["echo_median"])
    assert "deployment rounds" in text


def test_smoke_run_measures_fine_tuning_private_against_non_private(tmp_path):
    """`fed-dp benchmark --smoke --only finetune` (issue 38 item 3): LoRA GPT-2s, private and non-private rounds of the
    same users side by side; d is LoRA's (r = 8 on c_attn: 2 layers × 8 × (h + 3h)), and the bytes on the wire are
    the trainable part's, each way, not the full model's."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    results, text = _smoke(tmp_path, "finetune")
    rows = results["finetune"]
    assert [row["trainable"] for row in rows] == [2 * 8 * 4 * 64, 2 * 8 * 4 * 128]
    for row in rows:
        assert row["path"] == "one-step" and row["total"] > 10 * row["trainable"]
        assert row["ratio"] == pytest.approx(row["private_per_user"] / row["nonprivate_per_user"])
        assert 2 * 4 * row["trainable"] <= row["wire_bytes"] < 2 * 4 * row["trainable"] + 4096  # + array headers
        assert 2 * 4 * row["total"] <= row["wire_full_bytes"]
    assert "private / non-private" in text


def test_smoke_run_measures_every_other_section(tmp_path):
    """`fed-dp benchmark --smoke` of the remaining sections: scaling, a BandMF step, secure noise, accounting, GPU
    (skipped without CUDA), many small users, the training paths; saved JSON, text and figure."""
    results, text = _smoke(tmp_path, "rest")
    assert (tmp_path / "bench" / "benchmark.png").stat().st_size > 0 and "cohort scaling" in text
    for row in results["scaling"]["rows"]:
        assert row["overhead_ms_per_user"] == pytest.approx(1e3 * (row["round_seconds"] - row["plain_seconds"]) / row["cohort"])
    noise = results["noise"]
    rows = {row["name"]: row for row in noise["mechanisms"]}
    b, d, T, k = noise["bands"], noise["dim"], noise["horizon"], noise["participations"]
    assert list(rows) == ["independent", f"BandMF b = {b}", "BLT 2 buffers", "BLT 3 buffers"]
    assert rows[f"BandMF b = {b}"]["buffer_bytes"] == (b - 1) * d * 8 and rows["independent"]["buffer_bytes"] == 0  # float64
    assert rows["BLT 3 buffers"]["buffer_bytes"] == 3 * d * 8
    independent = rows["independent"]
    assert independent["error_min_sep"] == pytest.approx(k * (T + 1) / 2) and k == -(-T // b)  # C = I: k·‖A‖²/T
    assert independent["error_one"] == pytest.approx((T + 1) / 2)
    for row in rows.values():
        assert row["ratio"] == pytest.approx(row["step_seconds"] / noise["gaussian_seconds"])
        assert row["error_min_sep_vs_bandmf"] == pytest.approx(row["error_min_sep"] / rows[f"BandMF b = {b}"]["error_min_sep"])
        assert row["error_min_sep"] <= independent["error_min_sep"] and row["error_one"] <= independent["error_one"]
    secure = results["secure-noise"]["rows"][0]
    assert secure["device"] == "cpu" and secure["throughput_ratio"] == pytest.approx(
        secure["torch_seconds"] / secure["secure_seconds"])
    accounting = results["accounting"]
    assert accounting["epsilon"] == accounting["schedule_pld_last"] > 0  # T is an exact round of the schedule
    assert accounting["calibrated_sigma_pld"] <= accounting["calibrated_sigma_rdp"]  # PLD is tighter


def test_the_flower_baseline_app_reads_every_w1_field_from_its_run_config():
    """The `flwr run` launch of Flower's DP apps (system flower-dp-flwr-run) gets W1 from the run config: its
    pyproject lists exactly the baseline's fields, and the apps read them (dashes for underscores)."""
    import tomllib
    from dataclasses import fields

    from fed_dp.simulations.benchmark.flower_baseline import APP, _config

    config = tomllib.loads((APP / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert {key.replace("-", "_") for key in config} == {f.name for f in fields(BaselineConfig)}
    spec = W1Spec.smoke()
    run_config = {key.replace("_", "-"): value for key, value in asdict(spec.baseline("/tmp/x.json", 1)).items()}
    assert _config(run_config) == spec.baseline("/tmp/x.json", 1)


def test_the_gpu_section_measures_the_engine_against_the_limit_on_any_device():
    """`--only gpu` runs only with CUDA; its measurement itself runs on the CPU here (tiny sizes): both models,
    the engine's users/s against one model trained on the same examples in both batch sizes."""
    result = gpu.bench_gpu(W1Spec.smoke(), users=12, cohort=4, rounds=2, device="cpu",
                                 log=lambda *_: None)
    rows = result["rows"]
    assert [(row["model"], row["parameters"]) for row in rows] == [("w1-cnn", 25_578), ("cifar-cnn", 411_466)]
    for row in rows:
        for label in ("all", "1024"):
            assert row[f"ratio_to_limit_{label}"] == pytest.approx(
                row["users_per_second"] / row[f"limit_{label}_users_per_second"])
        assert row["engine_seconds"] > 0 and row["peak_gib"] is None and row["h2d_copies_per_round"] is None
    assert "engine/limit" in gpu.format_gpu(result) and result["device"] == "cpu"


def test_transfer_summary_counts_host_to_device_copies_and_synchronizations_per_round():
    # a 3-round run against a 1-round run: the setup both do (here 4,000 copies of users' data and 1 sync) cancels
    run = [("Memcpy HtoD (Pageable -> Device)", 4_030), ("Memcpy HtoD (Pinned -> Device)", 10),
           ("Memcpy DtoH (Device -> Pageable)", 7), ("cudaStreamSynchronize", 9), ("cudaDeviceSynchronize", 2),
           ("aten::add", 100)]
    one_round = [("Memcpy HtoD (Pageable -> Device)", 4_010), ("cudaStreamSynchronize", 3), ("aten::add", 40)]
    assert gpu.transfer_summary(run, 3, one_round) == {"h2d_copies_per_round": 15.0, "syncs_per_round": 4.0}
    with pytest.raises(ValueError, match="at least 2 rounds"):
        gpu.transfer_summary(run, 1, one_round)
