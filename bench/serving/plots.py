"""Plots from a result JSON (matplotlib, Agg): PNGs into bench/results/, the latest copied to
bench/plots/ for the README.

- normalized latency (mean E2EL / output tokens) against offered request rate, per system
- TTFT and ITL CDFs per system at one reference rate
- goodput bars: vLLM's goodput at the reference rate, DistServe's (highest rate with >= 90% SLO
  attainment) over the sweep
- tuning: TTFT P50/P99 against output throughput, one point per prefill setting
"""
from __future__ import annotations

import os
import shutil

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from bench.serving.record import PLOTS  # noqa: E402


def _systems(result: dict) -> dict[str, dict]:
    return {name: s for name, s in result["systems"].items() if s.get("points")}


def reference_rate(result: dict) -> float:
    """The middle rate of the sweep (the one the CDFs and vLLM goodput bars show)."""
    rates = result["sweep"]["rates"]
    return rates[(len(rates) - 1) // 2]


def _title(result: dict) -> str:
    w = result["sweep"]
    return f"{w['workload']}, {w['num_requests']} req/point, {result['sweep']['knobs']['dtype']}, " \
           f"{result['machine']['nproc']} CPUs"


def normalized_latency(result: dict, path: str) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, s in _systems(result).items():
        pts = [(p["rate"], p["metrics"]["normalized_latency_s"]) for p in s["points"]]
        ax.plot(*zip(*pts), marker="o", label=name)
    ax.set(xlabel="offered request rate (req/s)", ylabel="normalized latency (s/token)", yscale="log",
           title=f"Normalized latency — {_title(result)}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    _save(fig, path)


def cdfs(result: dict, path: str) -> None:
    rate = reference_rate(result)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, s in _systems(result).items():
        point = next((p for p in s["points"] if p["rate"] == rate), None)
        if point is None:
            continue
        done = [r for r in point["requests"] if r["success"]]
        _cdf(a, [r["ttft_ms"] for r in done], name)
        _cdf(b, [g for r in done for g in r["itl_ms"]], name)
    a.set(xlabel="TTFT (ms)", ylabel="fraction of requests", xscale="log", title=f"TTFT CDF at {rate:g} req/s")
    b.set(xlabel="ITL (ms)", ylabel="fraction of token gaps", xscale="log", title=f"ITL CDF at {rate:g} req/s")
    for ax in (a, b):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(_title(result))
    _save(fig, path)


def _cdf(ax, values: list[float], label: str) -> None:
    if values:
        xs = np.sort(np.maximum(values, 0.01))
        ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=label)


def goodput_bars(result: dict, path: str) -> None:
    rate = reference_rate(result)
    slo = result["sweep"]["slo"]
    names = list(_systems(result))
    vllm_gp = [next((p["metrics"]["goodput"] for p in result["systems"][n]["points"] if p["rate"] == rate), 0)
               for n in names]
    dist_gp = [result["systems"][n]["distserve_goodput"] for n in names]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar(names, vllm_gp, color="tab:blue")
    a.set(ylabel="req/s meeting every SLO", title=f"goodput (vLLM) at {rate:g} req/s offered")
    b.bar(names, dist_gp, color="tab:green")
    b.set(ylabel="highest swept rate (req/s)", title="goodput (DistServe): >= 90% SLO attainment")
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=20)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"SLOs: TTFT <= {slo['ttft_ms']:g} ms, TPOT <= {slo['tpot_ms']:g} ms — {_title(result)}")
    _save(fig, path)


def tuning(result: dict, path: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, cfg in enumerate(result["configs"]):
        m, color = cfg["metrics"], f"C{i % 10}"
        label = f"tok {cfg['max_num_batched_tokens']}, seqs {cfg['max_num_seqs']}"
        ax.plot([m["output_throughput"]] * 2, [m["ttft"]["p50"], m["ttft"]["p99"]], color=color, alpha=0.4)
        ax.scatter(m["output_throughput"], m["ttft"]["p50"], marker="o", color=color)
        ax.scatter(m["output_throughput"], m["ttft"]["p99"], marker="^", color=color)
        ax.annotate(label, (m["output_throughput"], m["ttft"]["p99"]), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    ax.set(xlabel="output throughput (tokens/s)", ylabel="TTFT (ms): o P50, ^ P99", yscale="log",
           title=f"{result['system']} prefill knobs on {result['workload_name']} at {result['rate']:g} req/s")
    ax.grid(True, alpha=0.3)
    _save(fig, path)


def _save(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_compare(result: dict, stem: str, publish: bool = True) -> list[str]:
    """All comparison plots as `<stem>_<kind>.png`; with `publish`, copied to bench/plots/ under
    stable names."""
    workload = result["sweep"]["workload"]
    made = []
    for kind, draw in (("normalized_latency", normalized_latency), ("cdf", cdfs), ("goodput", goodput_bars)):
        path = f"{stem}_{kind}.png"
        draw(result, path)
        made.append(path)
        if publish:
            os.makedirs(PLOTS, exist_ok=True)
            shutil.copy(path, os.path.join(PLOTS, f"{workload}_{kind}.png"))
    return made


def plot_tuning(result: dict, stem: str, publish: bool = True) -> str:
    path = f"{stem}_tuning.png"
    tuning(result, path)
    if publish:
        os.makedirs(PLOTS, exist_ok=True)
        shutil.copy(path, os.path.join(PLOTS, f"tuning_{result['system']}_{result['workload_name']}_"
                                              f"{result['rate']:g}rps.png"))
    return path
