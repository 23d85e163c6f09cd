"""The tuning script: every (optimizer, learning rate) of the grid trained on the tuning draw, best picked."""

from __future__ import annotations

import json

from fed_dp.simulations.experiments.runner import apply_overrides, load_config
from fed_dp.simulations.experiments.tune import best, grid_for, main, tune

TINY = ["task.groups=2", "task.largest=8", "task.users=16", "task.held-out=4", "privacy.expected-cohort=4",
        "privacy.rounds=2", "run.eval-every=1", 'run.optimizers=["dp-sgdm","dp-adam"]']


def test_tune_trains_each_grid_point_on_the_tuning_draw_and_picks_the_best(tmp_path, capsys):
    config = apply_overrides(load_config("main-job"), TINY)
    rows = tune(config, {"dp-sgdm": (0.1, 0.3), "dp-adam": (0.01,)}, seed=1, log=lambda *_: None)
    assert [(r["optimizer"], r["lr"]) for r in rows] == [("dp-sgdm", 0.1), ("dp-sgdm", 0.3), ("dp-adam", 0.01)]
    chosen = best(rows)
    sgdm = [r for r in rows if r["optimizer"] == "dp-sgdm"]
    assert chosen["dp-sgdm"] == max(sgdm, key=lambda r: (r["score"], -r["lr"]))["lr"] and chosen["dp-adam"] == 0.01
    assert best([{"optimizer": "a", "lr": 0.3, "score": 0.5}, {"optimizer": "a", "lr": 0.1, "score": 0.5}]) == {"a": 0.1}
    assert grid_for("dp-adambc") == grid_for("dp-adam-stp") and len(grid_for("dp-sgdm")) >= 3
    sets = [a for item in TINY for a in ("--set", item)]
    assert main(["main-job", *sets, "--grid", "dp-sgdm=0.3", "--grid", "dp-adam=", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "tuning.json").read_text())
    assert saved["seed"] == 1 and [r["optimizer"] for r in saved["runs"]] == ["dp-sgdm"]
    assert "best learning rate" in capsys.readouterr().out
