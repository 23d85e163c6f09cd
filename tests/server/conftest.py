"""Fixtures of the server tests: for the deployment tests (test_deployment.py, test_faults.py) TLS certificates and
Deployments that are stopped, and checked for leftover processes, after each test; ``server_log``, the ServerApp's
log messages."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from deployment import SEED, Deployment, make_certificates

from fed_dp.server.app import SERVER_SEED_VARIABLE


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> Path:
    """CA, server certificate and three SuperNode key pairs from server/make_certificates.sh."""
    return make_certificates(tmp_path_factory.mktemp("certificates"), nodes=3)


@pytest.fixture
def new_deployment(tmp_path, certificates, monkeypatch):
    """deployment(auth=...) → a TLS Deployment under tmp_path; stopped, and checked for leftovers, afterwards.
    Its SuperLink gets ``FED_DP_SERVER_SEED`` = run.seed (the ServerApp's sampler and noise seed, from the server's
    environment only), so that the tests can predict the cohorts and compare with the in-process engine; its
    processes get this folder on ``PYTHONPATH`` (the tests' task, deployment_task.py)."""
    monkeypatch.setenv(SERVER_SEED_VARIABLE, str(SEED))
    # the SuperLink's and SuperNodes' processes import the tests' task (deployment_task.py) from this folder
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    started: list[Deployment] = []

    def make(auth: bool = False) -> Deployment:
        d = Deployment(tmp_path / f"deployment{len(started)}", certificates, auth=auth)
        started.append(d)
        return d

    try:
        yield make
    finally:
        for d in started:
            d.stop()
    for d in started:
        assert not d.leftovers(), f"processes left behind: {d.leftovers()}"


@pytest.fixture
def server_log():
    """The messages of the ``fed_dp`` logger (which does not propagate to the root logger caplog reads)."""
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler, logger = Keep(level=logging.INFO), logging.getLogger("fed_dp")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)  # as configure_logging sets it in a ServerApp
    yield messages
    logger.removeHandler(handler)
    logger.setLevel(level)
