"""Round progress: a bar on a terminal, plain readable lines (no carriage return) in a log file."""

import io

import pytest

from fed_dp.simulations.engine.progress import RoundProgress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _records(count):
    return [{"round": r, "epsilon": 0.1 * r, "nonprivate_train_loss": 1.0 / r} for r in range(1, count + 1)]


def test_a_log_file_gets_plain_lines_every_n_rounds_and_after_the_last():
    stream = io.StringIO()
    progress = RoundProgress(25, "dp-adam", stream=stream, every_rounds=10, clock=lambda: 0.0)
    for record in _records(25):
        progress.update(record)
    progress.close()
    text = stream.getvalue()
    assert "\r" not in text
    assert text.splitlines() == ["dp-adam 10/25: epsilon 1.0000, train loss 0.1000",
                                 "dp-adam 20/25: epsilon 2.0000, train loss 0.0500",
                                 "dp-adam 25/25: epsilon 2.5000, train loss 0.0400"]


def test_a_log_file_gets_a_line_when_the_interval_has_passed():
    stream, now = io.StringIO(), [0.0]
    progress = RoundProgress(100, stream=stream, every_rounds=50, every_seconds=10.0, clock=lambda: now[0])
    for record in _records(3):
        now[0] += 6.0  # 6 s per round: a line after round 2 (12 s since the start), none after 1 and 3
        progress.update(record)
    assert stream.getvalue().splitlines() == ["rounds 2/100: epsilon 0.2000, train loss 0.5000"]


def test_a_terminal_gets_the_bar():
    stream = _Terminal()
    progress = RoundProgress(5, stream=stream)
    for record in _records(5):
        progress.update(record)
    progress.close()
    assert "\r" in stream.getvalue() and "rounds:" in stream.getvalue()


def test_not_private_epsilon_is_shown_as_text():
    stream = io.StringIO()
    progress = RoundProgress(1, stream=stream)
    progress.update({"round": 1, "epsilon": "not private", "nonprivate_train_loss": 0.5})
    assert stream.getvalue() == "rounds 1/1: epsilon not private, train loss 0.5000\n"


@pytest.mark.parametrize("total", [0, 1.5, True])
def test_bad_totals_are_refused(total):
    with pytest.raises(ValueError, match="total must be an integer >= 1"):
        RoundProgress(total, stream=io.StringIO())
