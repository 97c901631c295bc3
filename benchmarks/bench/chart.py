"""PNG chart of one run: median step time per contestant (ms, rank 0) with the interquartile
range as error bars; ours highlighted, failed contestants marked."""

from __future__ import annotations


def step_time_chart(results: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, med, lo, hi, colors = [], [], [], [], []
    for name, e in results["contestants"].items():
        s = e["step_time_s"]
        names.append(name if e["status"] == "ok" else f"{name}\n(failed)")
        if e["status"] != "ok" or not s.get("n"):
            med.append(0.0), lo.append(0.0), hi.append(0.0)
        else:
            med.append(s["median"] * 1e3)
            lo.append((s["median"] - s["q1"]) * 1e3)
            hi.append((s["q3"] - s["median"]) * 1e3)
        colors.append("tab:red" if name == "ours" else "tab:blue" if "dtensor" in name else "tab:gray")
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(names, med, yerr=[lo, hi], capsize=6, color=colors)
    for b, v, up in zip(bars, med, hi):
        if v:
            ax.annotate(f"{v:.0f}", (b.get_x() + b.get_width() / 2, v + up), ha="center",
                        va="bottom", fontsize=8, xytext=(0, 3), textcoords="offset points")
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color="tab:gray", label="one process"),
                       Patch(color="tab:blue", label="DTensor (torch)"),
                       Patch(color="tab:red", label="ours (backend=\"dist\")")],
              fontsize=8, loc="upper left")
    ax.set_ylim(0, max([m + h for m, h in zip(med, hi)] + [1]) * 1.15)
    n = max((e["step_time_s"].get("n", 0) for e in results["contestants"].values()), default=0)
    ax.set_ylabel("step time, ms (median, IQR bars)")
    ax.set_title(f"{results['workload']}: {results['machine']['world_size']} ranks, "
                 f"{results['machine']['device']}, {n} steps", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
