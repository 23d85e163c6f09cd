"""Test-wide setup: strategies optimized by the tests go to a temporary folder, never to ~/.cache; the identity
a ServerApp process has, for tests that create Flower instruction messages (fixture ``server_identity``)."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config):
    """Hugging Face libraries never reach for the hub in tests (``HF_HUB_OFFLINE``: the HF tests build their models
    from configs and local folders). On a pytest-xdist worker, one torch thread (and one OpenMP/MKL thread for the
    processes it starts: Flower's simulations, SuperNodes, ``fed-dp`` commands): the workers together already keep
    the cores busy, and two torch
    threads in each of three workers on CI's two cores spent the time switching between them. ``pytest -n 0`` keeps
    torch's default."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[variable] = "1"
        import torch

        torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def _strategy_cache_in_a_temporary_folder(tmp_path_factory):
    """$FED_DP_CACHE_DIR for the whole session (tests that need their own folder set it themselves)."""
    before = os.environ.get("FED_DP_CACHE_DIR")
    os.environ["FED_DP_CACHE_DIR"] = str(tmp_path_factory.mktemp("strategies"))
    yield
    if before is None:
        os.environ.pop("FED_DP_CACHE_DIR", None)
    else:
        os.environ["FED_DP_CACHE_DIR"] = before


@pytest.fixture
def server_identity():
    """What a ServerApp process has when Flower runs it (instruction messages carry it)."""
    from flwr.supercore.task_identity import TaskIdentity

    before = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = before



#: Tests that must not overlap, by group (node-id prefixes; the first matching group wins): on the workers of
#: pyproject's addopts each group runs on one worker, one test after another; every other test runs wherever a
#: worker is free. Flower's simulation engine (Ray, started in the test process or by ``flwr run``) runs in two
#: groups, so that at most two Ray simulations share the machine; the deployments (SuperLink, SuperNodes,
#: ClientApp processes, with reply timeouts) run one at a time; the benchmark's smoke deployment (one SuperNode,
#: its own ports, no timing asserted) runs beside them. The groups are of similar length (about 4–6 minutes
#: each on 2 cores), the critical path of the run. (pytest-xdist's own ``xdist_group`` mark has no effect with
#: pytest 9, whose node ids it can no longer rewrite: checked with pytest 9.2 and pytest-xdist 3.8.)
XDIST_GROUPS = {
    "flower-simulation-b": ("tests/server/test_flower_simulation.py::test_kill_and_resume",
                            "tests/server/test_bad_replies.py::",
                            "tests/simulations/test_benchmark.py::test_smoke_run_measures_w1_side_by_side",
                            "tests/test_examples.py::test_your_own_server_and_client_apps_run_with_flwr_run"),
    "flower-simulation-a": ("tests/server/test_flower_simulation.py::",),
    "deployment": ("tests/server/test_deployment.py::", "tests/server/test_faults.py::"),
}
#: Tests of a minute or more in no group: collected first, so that they start at the beginning instead of leaving
#: one worker alone with them at the end (the scheduler hands out groups largest first, then single tests in
#: collection order).
STARTED_FIRST = ("tests/test_readme.py::test_main_job_command_runs_and_reproduces_the_readme_table",)


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.nodeid not in STARTED_FIRST)  # stable: every other test keeps its order


def xdist_group(nodeid: str) -> str:
    """The group of a test (its XDIST_GROUPS name), or its own node id: the unit pytest-xdist hands to a worker."""
    return next((name for name, prefixes in XDIST_GROUPS.items() if nodeid.startswith(prefixes)), nodeid)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scope scheduling with XDIST_GROUPS as the scopes (see there)."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid)

    return GroupScheduling(config, log)
