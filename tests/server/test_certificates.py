"""server/make_certificates.sh: a second run with $SUPERLINK_SAN issues the server certificate again with those
names (the first run kept them out); a run without it keeps the certificate; node keys are added."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from deployment import CERTIFICATE_SCRIPT

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None or shutil.which("ssh-keygen") is None,
                                reason="needs openssl and ssh-keygen")


def make(folder, nodes: int, san: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "SUPERLINK_SAN"} | ({"SUPERLINK_SAN": san} if san else {})
    return subprocess.run(["bash", str(CERTIFICATE_SCRIPT), str(folder), str(nodes)], check=True, text=True,
                          capture_output=True, env=env).stdout


def names(folder) -> str:
    return subprocess.run(["openssl", "x509", "-in", str(folder / "server.pem"), "-noout", "-ext", "subjectAltName"],
                          check=True, text=True, capture_output=True).stdout


def test_a_second_run_with_superlink_san_adds_the_names_and_a_run_without_keeps_them(tmp_path):
    make(tmp_path, 1)
    assert "DNS:localhost" in names(tmp_path) and "superlink.example.org" not in names(tmp_path)
    key = (tmp_path / "server.key").read_bytes()

    printed = make(tmp_path, 2, san="DNS:superlink.example.org,IP:10.0.0.5")
    assert "DNS:superlink.example.org" in names(tmp_path) and "IP Address:10.0.0.5" in names(tmp_path)
    assert "DNS:superlink.example.org,IP:10.0.0.5" in printed and (tmp_path / "node1.pub").exists()
    assert (tmp_path / "server.key").read_bytes() == key  # the same key, a new certificate

    certificate = (tmp_path / "server.pem").read_bytes()
    make(tmp_path, 3)
    assert (tmp_path / "server.pem").read_bytes() == certificate and (tmp_path / "node2.pub").exists()
    subprocess.run(["openssl", "verify", "-CAfile", str(tmp_path / "ca.crt"), str(tmp_path / "server.pem")], check=True,
                   capture_output=True)
