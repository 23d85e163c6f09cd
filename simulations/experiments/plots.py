"""PNG figures of simulation results (matplotlib, no display needed).

    metrics.png         eval accuracy and loss vs round, and accuracy vs ε, one line per optimizer
    groups.png          accuracy per frequency group vs round (seed 003 style), when the task has groups
    groups_epsilon.png  training loss and accuracy, overall and for four frequency groups, vs user-level ε (seed 003
                        Figure 2's layout: the most frequent group, two middle ones, the rarest)
    second_moment.png   fraction of coordinates with ν̂ − Φ̂ < 0 (seed 000 Fig. 4) and the quartiles of ν̂
                        (seed 001 Table 1) vs round, for the adaptive optimizers
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

Results = dict[str, list[dict[str, Any]]]


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    points = [(r["round"], r[key]) for r in records if isinstance(r.get(key), (int, float))]  # 0: initial model
    return [p[0] for p in points], [p[1] for p in points]


def _label(name: str, records: list[dict[str, Any]]) -> str:
    """The legend entry of a run: its name, marked when it is the non-private baseline (noise_multiplier = 0)."""
    return f"{name} (NON-PRIVATE)" if any(r.get("non_private") for r in records) else name


def plot_metrics(results: Results, path: Path) -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, records in results.items():
        for ax, key in zip(axes[:2], ("eval_accuracy", "eval_loss")):
            ax.plot(*_series(records, key), marker=".", label=_label(name, records))
        eps = [(r["epsilon"], r["eval_accuracy"]) for r in records
               if isinstance(r.get("epsilon"), float) and "eval_accuracy" in r]
        if eps:
            axes[2].plot([e for e, _ in eps], [a for _, a in eps], marker=".", label=name)
    axes[0].set(title="accuracy vs round", xlabel="round", ylabel="eval accuracy")
    axes[1].set(title="loss vs round", xlabel="round", ylabel="eval loss")
    axes[2].set(title="accuracy vs user-level ε (private runs only)", xlabel="ε", ylabel="eval accuracy")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if any(r.get("non_private") for records in results.values() for r in records):
        fig.suptitle("NON-PRIVATE baseline included (noise_multiplier = 0: no noise, ε infinite)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_groups(results: Results, path: Path) -> Path | None:
    groups = sorted({k for rs in results.values() for r in rs for k in r
                     if k.startswith("group") and k.endswith("_accuracy")}, key=lambda k: int(k[5:].split("_")[0]))
    if not groups:
        return None
    cols = min(4, len(groups))
    rows = (len(groups) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.8 * cols, 3.2 * rows), squeeze=False)
    for ax, group in zip(axes.flat, groups):
        for name, records in results.items():
            ax.plot(*_series(records, group), label=name)
        ax.set(title=group.replace("_accuracy", "").replace("group", "frequency group "), xlabel="round",
               ylabel="accuracy", ylim=(-0.02, 1.02))
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(groups):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("accuracy per frequency group (group 0: most frequent classes)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _shown_groups(count: int) -> list[int]:
    """Four of ``count`` frequency groups as seed 003's Figure 2 shows them for G = 8: 0, 3, 5 and 7."""
    return sorted({0, round(3 * count / 8), round(5 * count / 8), count - 1} & set(range(count)))


def plot_groups_vs_epsilon(results: Results, path: Path) -> Path | None:
    """Loss (top) and accuracy (bottom) against ε: overall, then per shown group, one line per optimizer."""
    count = len({k for rs in results.values() for r in rs for k in r if k.startswith("group") and k.endswith("_loss")})
    private = {n: rs for n, rs in results.items() if any(isinstance(r.get("epsilon"), float) for r in rs)}
    if not count or not private:
        return None
    panels = [("eval", "overall")] + [(f"group{g}", f"frequency group {g}") for g in _shown_groups(count)]
    fig, axes = plt.subplots(2, len(panels), figsize=(3.6 * len(panels), 6.4), squeeze=False)
    for column, (prefix, title) in enumerate(panels):
        for row, metric in enumerate(("loss", "accuracy")):
            ax = axes[row][column]
            for name, records in private.items():
                points = [(r["epsilon"], r[f"{prefix}_{metric}"]) for r in records
                          if isinstance(r.get("epsilon"), float) and isinstance(r.get(f"{prefix}_{metric}"), (int, float))]
                ax.plot([e for e, _ in points], [v for _, v in points], label=name)
            ax.set(title=f"{title}: {metric}", xlabel="user-level ε")
            if metric == "accuracy":
                ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("training loss and accuracy per frequency group against ε (group 0: most frequent classes)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_second_moment(results: Results, path: Path) -> Path | None:
    adaptive = {n: rs for n, rs in results.items() if any("nu_hat_median" in r for r in rs)}
    if not adaptive:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, records in adaptive.items():
        rounds, fraction = _series(records, "fraction_nu_hat_below_phi")
        if fraction:
            axes[0].plot(rounds, fraction, label=name)
        rounds, median = _series(records, "nu_hat_median")
        line, = axes[1].plot(rounds, median, label=f"{name} median")
        _, q25 = _series(records, "nu_hat_q25")
        _, q75 = _series(records, "nu_hat_q75")
        axes[1].fill_between(rounds, q25, q75, alpha=0.2, color=line.get_color())
    axes[0].set(title="fraction of coordinates with ν̂ − Φ̂ < 0", xlabel="round", ylim=(-0.02, 1.02))
    axes[1].set(title="ν̂: median and quartiles", xlabel="round", yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(results: Results, folder: str | Path) -> list[Path]:
    """Write every figure that applies to ``results`` into ``folder``; returns the files written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = [plot_metrics(results, folder / "metrics.png"),
               plot_groups(results, folder / "groups.png"),
               plot_groups_vs_epsilon(results, folder / "groups_epsilon.png"),
               plot_second_moment(results, folder / "second_moment.png")]
    return [p for p in written if p is not None]
