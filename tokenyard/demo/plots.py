"""Learning-curve plot of the demo training runs (PNG)."""
from __future__ import annotations

import json
from pathlib import Path


def plot_learning_curves(run_dirs: dict[str, Path], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    histories = {name: json.loads((d / "history.json").read_text()) for name, d in run_dirs.items()
                 if (d / "history.json").is_file()}
    tasks = sorted({t for h in histories.values() for t in h["exact"]})
    cols = 4
    rows = -(-(len(tasks) + 1) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    ax = axes[0][0]
    for name, h in histories.items():
        ax.plot([s / 60 for s in h["seconds"]], h["loss"], label=name)
    ax.set_title("train loss (answer tokens)")
    ax.set_xlabel("minutes")
    ax.legend()
    for i, task in enumerate(tasks, start=1):
        ax = axes[i // cols][i % cols]
        for name, h in histories.items():
            ax.plot([s / 60 for s in h["seconds"]], h["exact"][task], label=name)
        ax.set_title(f"{task}: validation exact match")
        ax.set_ylim(0, 1)
        ax.set_xlabel("minutes")
    for j in range(len(tasks) + 1, rows * cols):
        axes[j // cols][j % cols].axis("off")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
