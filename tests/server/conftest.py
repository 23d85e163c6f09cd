"""Fixtures of the deployment tests (test_deployment.py, test_faults.py): TLS certificates and Deployments that
are stopped, and checked for leftover processes, after each test."""

from __future__ import annotations

from pathlib import Path

import pytest
from deployment import Deployment, make_certificates


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> Path:
    """CA, server certificate and three SuperNode key pairs from server/make_certificates.sh."""
    return make_certificates(tmp_path_factory.mktemp("certificates"), nodes=3)


@pytest.fixture
def new_deployment(tmp_path, certificates):
    """deployment(auth=...) → a TLS Deployment under tmp_path; stopped, and checked for leftovers, afterwards."""
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


