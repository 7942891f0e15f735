"""Pictures a run leaves beside its checkpoints: --grpo's reward over iterations (matplotlib, no display)."""

from __future__ import annotations

import os

from hybrid.training.logging import log


def reward_plot(points: list, path: str) -> str:
    """points [(iteration, reward mean, reward std[, {reward column: its mean}])] -> a PNG at `path` (the weighted
    mean, a band of one std, and each reward function's own mean where there are several)."""
    import matplotlib  # not at the top: only --grpo runs draw, and matplotlib's import takes a second
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # (see above)
    iterations = [p[0] for p in points]
    mean = [p[1] for p in points]
    std = [p[2] for p in points]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.fill_between(iterations, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2,
                    label="± one std of the batch")
    ax.plot(iterations, mean, marker="o", markersize=3, label="mean reward (weighted sum)")
    names = sorted({name for p in points if len(p) > 3 for name in p[3]})
    for name in names if len(names) > 1 else []:  # each function's own curve (TRL's rewards/NAME/mean)
        at = [(p[0], p[3][name]) for p in points if len(p) > 3 and name in p[3]]
        ax.plot([i for i, _ in at], [v for _, v in at], linestyle="--", linewidth=1, label=name)
    ax.set_xlabel("iteration")
    ax.set_ylabel("reward")
    ax.set_title("GRPO: reward of the engine's own completions")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    log(f"--grpo: the reward over iterations is drawn in {path}")
    return path
