"""Plots of the on-paper study: goodput per node against the offered rate, colocated replicas
beside the planner's P:D split, one panel per workload, one figure per profile."""
from __future__ import annotations

import os

from bench.serving.record import PLOTS


def plot_study(result: dict) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(PLOTS, exist_ok=True)
    made = []
    for path, prof in result["profiles"].items():
        workloads = sorted({p["request"]["workload"] for p in prof["plans"]})
        fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4), squeeze=False)
        for ax, workload in zip(axes[0], workloads):
            plans = [p for p in prof["plans"] if p["request"]["workload"] == workload]
            rates = [p["request"]["rate"] for p in plans]
            for key, label, marker in (("colocated", "colocated replicas", "o"), ("disaggregated", "planner's P:D", "s")):
                ax.plot(rates, [p[key]["goodput_per_node"] if p[key]["summary"] else float("nan") for p in plans],
                        marker=marker, label=label)
                for r, p in zip(rates, plans):
                    if not p[key]["summary"]:
                        continue            # none found: no point
                    ax.annotate(p[key]["topology"].replace(" colocated", ""), (r, p[key]["goodput_per_node"]),
                                fontsize=7, textcoords="offset points", xytext=(3, 4))
            ax.set_xscale("log")
            ax.set_xlabel("offered rate (requests/s)")
            ax.set_ylabel("goodput per node (requests/s)")
            ax.set_title(workload)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        name = os.path.basename(path).removesuffix(".json")
        ttft, tpot = prof["slo_ms"]
        fig.suptitle(f"{name}{' (extrapolated)' if prof['extrapolated'] else ''}: SLOs TTFT {ttft:g} ms, "
                     f"TPOT {tpot:g} ms, 90% attainment (simulated"
                     + (f", after {result['warmup_s']:g} s of warm-up)" if result.get("warmup_s") else ")"), fontsize=9)
        fig.tight_layout()
        png = os.path.join(PLOTS, "_".join(filter(None, ("planner_study", name, result.get("tag")))) + ".png")
        fig.savefig(png, dpi=110)
        plt.close(fig)
        made.append(png)
    return made
