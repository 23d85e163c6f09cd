"""Test-wide setup: strategies optimized by the tests go to a temporary folder, never to ~/.cache; the identity
a ServerApp process has, for tests that create Flower instruction messages (fixture ``server_identity``)."""

from __future__ import annotations

import os

import pytest


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


#: Tests of a minute or more that belong to no xdist_group: collected first, so that on two workers
#: (pyproject addopts) they start at the beginning instead of leaving one worker alone with them at the end
#: (pytest-xdist hands out groups largest first, then single tests in collection order).
STARTED_FIRST = ("tests/test_readme.py::test_main_job_command_runs_and_reproduces_the_readme_table",)


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.nodeid not in STARTED_FIRST)  # stable: every other test keeps its order
