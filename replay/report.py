"""A replay's output: the table per policy, the JSON document, and the PNG plots.

Everything here works on the JSON-able document (``document``), so plots can be redrawn from a
saved ``--json`` file. matplotlib is imported only by ``write_plots`` (extra ``plots``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from replay.metrics import load_over_time, quantile

SCHEMA_VERSION = 1
CDF_POINTS = 200
# (title, width, format spec, summary key)
_TABLE_COLUMNS = (
    ("policy", -19, "", "policy"),
    ("hit", 6, ".1%", "hit_rate"),
    ("TTFT mean", 9, ".3f", "ttft_mean_s"),
    ("p50", 7, ".3f", "ttft_p50_s"),
    ("p99", 7, ".3f", "ttft_p99_s"),
    ("in tok/s/wkr", 12, ".0f", "input_tokens_per_s_per_worker"),
    ("imbal", 6, ".2f", "load_imbalance"),
    ("SWA-lost tok", 12, "d", "swa_lost_tokens"),
    ("err", 4, "d", "num_errors"),
    ("rej", 4, "d", "num_rejected"),
)


def policy_entry(result: Any) -> dict[str, Any]:
    """One ``ReplayResult`` as its JSON entry (summary, engines, TTFT CDF, load over time)."""
    ttfts = sorted(t for r in result.records if (t := r.ttft_s) is not None)
    qs = [i / (CDF_POINTS - 1) for i in range(CDF_POINTS)]
    times, rates = load_over_time(result.records, result.worker_ids)
    return {
        "summary": result.summary.to_dict(),
        "rate_scale": result.config.rate_scale,
        "wall_s": result.wall_s,
        "cpu_s": result.cpu_s,
        "engines": result.engine_stats,
        "ttft_cdf": {"q": qs, "ttft_s": [quantile(ttfts, q) if q else ttfts[0] if ttfts else 0.0
                                         for q in qs]},
        "load_over_time": {"t_s": times, "prompt_tokens_per_s": rates},
    }


def document(workload: Mapping[str, Any], config: Any, policies: Mapping[str, dict[str, Any]],
             capacity: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``--json`` document: workload, config, one entry per policy, capacity, targets."""
    cfg = asdict(config) if not isinstance(config, Mapping) else dict(config)
    doc = {"schema_version": SCHEMA_VERSION, "workload": dict(workload), "config": cfg,
           "policies": dict(policies), "capacity": dict(capacity or {})}
    doc["targets"] = targets(doc)
    return doc


def targets(doc: Mapping[str, Any]) -> dict[str, Any]:
    """Issue 9's targets, for the policies present (a missing one leaves its checks out)."""
    s = {name: p["summary"] for name, p in doc["policies"].items()}
    ours = s.get("agentgate")
    out: dict[str, Any] = {}
    if ours is None:
        return out
    if "global" in s and s["global"]["hit_rate"]:
        out["hit_vs_global"] = ours["hit_rate"] / s["global"]["hit_rate"]
    if "least-loaded" in s and s["least-loaded"]["hit_rate"]:
        out["hit_vs_least_loaded"] = ours["hit_rate"] / s["least-loaded"]["hit_rate"]
    baselines = [n for n in s if n not in ("agentgate", "global")]
    if baselines:
        out["ttft_mean_below_all_baselines"] = all(
            ours["ttft_mean_s"] < s[n]["ttft_mean_s"] for n in baselines)
        out["ttft_p99_below_all_baselines"] = all(
            ours["ttft_p99_s"] < s[n]["ttft_p99_s"] for n in baselines)
    cap = doc.get("capacity", {}).get("policies", {})
    if "agentgate" in cap and "least-loaded" in cap:
        ll = cap["least-loaded"]["input_tokens_per_s_per_worker"]
        if ll:
            out["capacity_vs_least_loaded"] = (
                cap["agentgate"]["input_tokens_per_s_per_worker"] / ll)
    return out


def table(doc: Mapping[str, Any]) -> str:
    """The per-policy table (and the capacity and target lines when present)."""
    lines = [" ".join(_cell(title, width, "") for title, width, _, _ in _TABLE_COLUMNS)]
    for entry in doc["policies"].values():
        s = entry["summary"]
        lines.append(" ".join(_cell(s[key], width, spec) for _, width, spec, key in _TABLE_COLUMNS))
    lines.append("TTFT in seconds; hit = window-safe cached prompt tokens / prompt tokens")
    cap = doc.get("capacity") or {}
    if cap.get("policies"):
        lines.append(f"capacity: highest rate scale of {cap['scales']} with TTFT p99 <= "
                     f"{cap['reference_policy']}'s at scale 1 ({cap['reference_p99_s']:.3f} s)")
        for name, c in cap["policies"].items():
            scale = "none" if c["scale"] is None else f"{c['scale']:g}x"
            lines.append(f"  {name:<19} {scale:>6}  {c['input_tokens_per_s_per_worker']:10.0f} "
                         "input tok/s per worker")
    for key, value in doc.get("targets", {}).items():
        lines.append(f"target {key}: {value:.3f}" if isinstance(value, float)
                     else f"target {key}: {value}")
    return "\n".join(lines)


def _cell(value: Any, width: int, spec: str) -> str:
    text = format(value, spec)
    return text.ljust(-width) if width < 0 else text.rjust(width)


def write_json(doc: Mapping[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")


def write_plots(doc: Mapping[str, Any], out_dir: str | Path) -> list[Path]:
    """ttft_cdf.png, hit_rate.png, load_per_worker.png in ``out_dir``; returns their paths.

    Raises:
        RuntimeError: matplotlib is not installed (``pip install 'agentgate[plots]'``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("--plots needs matplotlib: pip install 'agentgate[plots]' "
                           "(or pip install matplotlib)") from e
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    policies = doc["policies"]
    return [_cdf(plt, policies, out / "ttft_cdf.png"), _hits(plt, policies, out / "hit_rate.png"),
            _load(plt, policies, out / "load_per_worker.png")]


def _cdf(plt: Any, policies: Mapping[str, Any], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, p in policies.items():
        ax.plot(p["ttft_cdf"]["ttft_s"], p["ttft_cdf"]["q"], label=name)
    ax.set_xscale("symlog", linthresh=0.1)
    ax.set(xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDF per policy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def _hits(plt: Any, policies: Mapping[str, Any], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = list(policies)
    ax.bar(names, [100 * policies[n]["summary"]["hit_rate"] for n in names])
    ax.set(ylabel="window-safe hit rate (%)", title="Prompt tokens served from cache")
    ax.tick_params(axis="x", rotation=30)
    return _save(plt, fig, path)


def _load(plt: Any, policies: Mapping[str, Any], path: Path) -> Path:
    n = len(policies)
    fig, axes = plt.subplots(n, 1, figsize=(8, 2.2 * n), sharex=True, squeeze=False)
    for ax, (name, p) in zip(axes[:, 0], policies.items()):
        load = p["load_over_time"]
        for worker, rates in load["prompt_tokens_per_s"].items():
            ax.plot(load["t_s"], rates, linewidth=0.8, label=worker)
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("prompt tok/s", fontsize=8)
    axes[-1, 0].set_xlabel("virtual time (s)")
    return _save(plt, fig, path)


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def capacity_entry(reference: str, reference_p99_s: float, scales: Sequence[float],
                   runs: Mapping[str, Mapping[float, Mapping[str, Any]]]) -> dict[str, Any]:
    """The capacity block: per policy, the highest scale whose TTFT p99 stays within the
    reference's p99 at scale 1, and the input throughput per worker there.

    ``runs[policy][scale]`` is a run's summary dict.
    """
    out: dict[str, Any] = {}
    for name, by_scale in runs.items():
        # NOTE: the highest scale reached without a failing scale below it (p99 need not be
        # monotonic in the scale; a pass above a failure does not count)
        best = None
        for sc in sorted(by_scale):
            if by_scale[sc]["ttft_p99_s"] > reference_p99_s:
                break
            best = sc
        tput = by_scale[best]["input_tokens_per_s_per_worker"] if best is not None else 0.0
        out[name] = {"scale": best, "input_tokens_per_s_per_worker": tput,
                     "runs": {str(sc): {"ttft_p99_s": by_scale[sc]["ttft_p99_s"],
                                        "ttft_mean_s": by_scale[sc]["ttft_mean_s"],
                                        "hit_rate": by_scale[sc]["hit_rate"],
                                        "input_tokens_per_s_per_worker":
                                            by_scale[sc]["input_tokens_per_s_per_worker"]}
                              for sc in sorted(by_scale)}}
    return {"reference_policy": reference, "reference_p99_s": reference_p99_s,
            "scales": list(scales), "policies": out}
