"""Per-rank bytes of a dry run as a picture: what each trainer GPU sends and each rollout GPU receives, one
series per replica policy, so that an imbalance shows at a glance. Needs matplotlib (the ``test`` extra)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import DryRunSpecError

__all__ = ["plot_traffic"]


def plot_traffic(results: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Write a PNG of bytes sent per trainer rank and received per rollout rank, one bar series per result
    (``dry_run`` dicts, e.g. one per policy). Returns the path written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise DryRunSpecError(
            "--plot needs matplotlib (pip install matplotlib, or the project's test extra)"
        ) from None
    if not results:
        raise DryRunSpecError("nothing to plot")
    out = Path(path)
    first = results[0]
    fig, axes = plt.subplots(2, 1, figsize=(12, 7), constrained_layout=True)
    panels = (
        (axes[0], "sent_per_trainer_rank", "bytes sent per trainer GPU", 0),
        (
            axes[1],
            "received_per_rollout_rank",
            "bytes received per rollout GPU",
            len(first["sent_per_trainer_rank"]),
        ),
    )
    width = 0.8 / len(results)
    for ax, key, title, first_rank in panels:
        for k, result in enumerate(results):
            values = [v / 1e9 for v in result[key]]
            xs = [first_rank + i - 0.4 + width * (k + 0.5) for i in range(len(values))]
            mean = sum(values) / len(values) if values else 0.0
            label = (
                f"{result['policy']}: max {max(values, default=0):.1f} GB, mean {mean:.1f} GB;"
                f" modeled sync {result['modeled_s']:.3f} s"
            )
            ax.bar(xs, values, width=width, label=label)
        top = max((v for r in results for v in r[key]), default=0) / 1e9
        ax.set_ylim(0, top * 1.4 if top > 0 else 1.0)  # room for the legend
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(title)
        ax.set_xlabel("global rank")
        ax.set_ylabel("GB")
        ax.legend(loc="upper right")
    fig.suptitle(
        f"{first['model']}: trainer {first['trainer']} -> rollout {first['rollout']}"
        f" (ingress lower bound {first['lower_bound_s']:.3f} s)",
        fontsize=10,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
