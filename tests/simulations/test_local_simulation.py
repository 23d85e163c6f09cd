"""fed_dp.simulations.launch.local_simulation: ``flwr run`` of the project's app from Python, isolated. The Flower
runs it starts are tested in tests/server/test_flower_simulation.py."""

from __future__ import annotations

import subprocess

from fed_dp.simulations.launch import local_simulation
from fed_dp.simulations.launch.local_simulation import FLWR, bundle_folder


def test_flwr_run_from_the_bundle_folder_bundles_the_same_app(tmp_path):
    """`flwr run` is started in a folder holding only the files the app bundles (local_simulation); the bundle Flower
    builds from it is byte for byte the one it builds from the project folder itself."""
    staged = bundle_folder(local_simulation.REPO, tmp_path / "bundle")
    assert staged != local_simulation.REPO and sorted(p.name for p in staged.iterdir()) == ["README.md", "pyproject.toml"]
    built = {}
    for name, folder in (("project", local_simulation.REPO), ("bundle", staged)):
        out = tmp_path / f"built-{name}"
        out.mkdir()
        done = subprocess.run([FLWR, "build", "--app", str(folder)], cwd=out, env=local_simulation.flwr_env(tmp_path / name),
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        (fab,) = out.glob("*.fab")
        built[name] = fab.read_bytes()
    assert built["project"] == built["bundle"]
