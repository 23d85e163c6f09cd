"""The Flower run config: pyproject's keys = DEFAULTS, one parse into fed_dp dataclasses, task keys."""

from __future__ import annotations

import tomllib

import pytest
from flwr.common.config import flatten_dict

from fed_dp.accounting import epsilon
from fed_dp.server.config import DEFAULTS, parse_app_config, task_params
from flower_run import REPO


def test_pyproject_run_config_lists_exactly_the_defaults():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert flatten_dict(config) == DEFAULTS


def test_parse_builds_the_fed_dp_configs_and_honours_sentinels():
    app = parse_app_config({})
    assert app.experiment.privacy.epsilon_budget is None and not app.seeded_explicitly
    assert app.optimizer_name == "dp-adam" and app.experiment.optimizers["dp-adam"] == {"lr": 0.01}
    calibrated = parse_app_config({"privacy.target-epsilon": 3.0, "privacy.epsilon-budget": 5.0, "run.seed": 2})
    assert epsilon(calibrated.experiment.privacy) <= 3.0 and calibrated.experiment.privacy.epsilon_budget == 5.0
    assert calibrated.seeded_explicitly and calibrated.seed == 2


@pytest.mark.parametrize("bad, message", [({"privacy.sampler": "uniform"}, "sampler"),
                                          ({"optimizer.name": "dp-lion"}, "unknown optimizer"),
                                          ({"colour.red": 1}, "unknown run-config")])
def test_invalid_run_configs_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        parse_app_config(bad)


def test_task_params_keep_only_what_the_task_takes():
    assert task_params({})["groups"] == 3
    assert "groups" not in task_params({"task.name": "sparse-logreg-1d"})
    with pytest.raises(ValueError, match="does not apply"):
        task_params({"task.name": "sparse-logreg-1d", "task.groups": 5})
    with pytest.raises(ValueError, match="reads local files"):
        task_params({"task.name": "cifar10"})
    assert task_params({"task.name": "cifar10", "task.root": "/a"}, node_root="/b")["root"] == "/b"
