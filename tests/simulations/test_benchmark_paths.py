"""`fed-dp benchmark --only paths`: every path runs on every workload and auto's ratio is its time over the fastest."""

from __future__ import annotations

import pytest

from fed_dp.simulations.benchmark import paths as benchmark_paths


def test_the_paths_section_times_every_path_and_names_the_one_auto_took():
    rows = benchmark_paths.bench_paths(benchmark_paths.workloads(smoke=True), rounds=2, log=lambda *_: None)
    assert [r["workload"] for r in rows] == ["heavy-tail linear (G = 6, L = 64), 1 example, one step",
                                             "W1 CNN, 32 images, one step"]
    # one-example users of a linear model: closed-form norms; the CNN's would cost more than a model per user
    assert [r["auto_path"] for r in rows] == ["one-step", "sequential"]
    for row in rows:
        assert all(row[path] > 0 for path in benchmark_paths.PATHS)
        assert row["auto_over_fastest"] == pytest.approx(row["auto"] / min(row[p] for p in benchmark_paths.PATHS))
    text = benchmark_paths.format_paths(rows)
    assert "(one-step)" in text and "(sequential)" in text and "auto / fastest" in text
