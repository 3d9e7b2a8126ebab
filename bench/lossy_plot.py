"""The plot of bench/lossy.py: per run, the ratio against the raw fp32 state (x, log) and the
worst held-out loss change of a reconstructed checkpoint (y), the lossy tier against the
ExCP re-implementation. Needs only matplotlib (no torch), so it also runs on its own:

    python bench/lossy_plot.py bench/out/lossy.json docs/img/lossy.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

_NAMES = {"ours": "ckptstore lossy", "excp": "ExCP (re-implemented)"}


def plot(runs: dict[str, dict[str, Any]], path: Path) -> None:
    """Write the plot of ``lossy.json``'s ``runs`` to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, len(runs), figsize=(6.2 * len(runs), 4.6), squeeze=False)
    for ax, (run, r) in zip(axes[0], runs.items(), strict=True):
        for method, style in (("ours", "o"), ("excp", "s")):
            rows = [x for x in r["settings"] if x["method"] == method]
            ax.scatter(
                [x["ratio"] for x in rows],
                [x["max_eval_change_pct"] for x in rows],
                marker=style,
                label=_NAMES[method],
            )
            for x in rows:
                tag = x["label"].replace("ours ", "").replace("excp ", "")
                ax.annotate(tag, (x["ratio"], x["max_eval_change_pct"]), fontsize=6)
        ax.axhline(0.5, color="grey", ls=":", lw=1)
        ax.axvline(40, color="grey", ls=":", lw=1)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_yscale("symlog", linthresh=0.1)
        low = min(x["max_eval_change_pct"] for x in r["settings"])
        ax.set_ylim(bottom=min(low * 1.5, -0.05))
        ax.set_xlabel("ratio vs raw fp32 state (weights + Adam moments)")
        ax.set_ylabel("worst held-out loss change of a checkpoint (%)")
        ax.set_title(run)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)


if __name__ == "__main__":
    plot(json.loads(Path(sys.argv[1]).read_text())["runs"], Path(sys.argv[2]))
