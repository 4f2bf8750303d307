"""The demo's picture: memory per instance over time, the budget, and the load phases."""

from __future__ import annotations

MIB = 1 << 20
COLORS = ("#1f77b4", "#d62728")            # one per instance, in the view's order
PHASE_SHADES = ("#f2f2f2", "#e0e0e0")


def write_png(record: dict, path: str) -> None:
    """Draw ``record`` (see kvcached.demo.run: the JSON written beside the PNG) into ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = record["samples"]
    t = [s["t_s"] for s in samples]
    budget_mib = record["budget"]["bytes"] / MIB
    fig, (mem, rate) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True, height_ratios=(3, 1.2),
                                    layout="constrained")
    for axis in (mem, rate):
        for i, phase in enumerate(record["phases"]):
            axis.axvspan(phase["start_s"], phase["end_s"], color=PHASE_SHADES[i % 2], zorder=0)
    names = [instance["name"] for instance in record["instances"]]
    for phase in record["phases"]:
        middle = (phase["start_s"] + phase["end_s"]) / 2
        mem.text(middle, 1.06, phase["label"], transform=mem.get_xaxis_transform(), ha="center", va="bottom",
                 fontsize=10, fontweight="bold")
        clients = ", ".join(f"{name} {round(share * record['workload']['clients'])}"
                            for name, share in zip(names, phase["share"]))
        mem.text(middle, 1.01, f"clients: {clients}", transform=mem.get_xaxis_transform(), ha="center",
                 va="bottom", fontsize=8, color="0.3")

    for i, instance in enumerate(record["instances"]):
        color = COLORS[i % len(COLORS)]
        mapped = [s["instances"][i]["mapped_bytes"] / MIB for s in samples]
        live = [s["instances"][i]["used_bytes"] / MIB for s in samples]
        mem.plot(t, mapped, color=color, lw=2.2, label=f"{instance['name']} ({instance['preset']} model): mapped")
        mem.plot(t, [s["instances"][i].get("share_bytes", 0) / MIB for s in samples], color=color, lw=1.2, ls="--",
                 label=f"{instance['name']}: its fair share of the budget")
        mem.fill_between(t, live, color=color, alpha=0.15, lw=0, label=f"{instance['name']}: in pages with live blocks")
        rate.plot(t, [s["instances"][i]["tokens_per_s"] for s in samples], color=color, lw=1.8,
                  label=f"{instance['name']}: tokens/s")
        preempted = [s["instances"][i]["preemptions"] for s in samples]
        hits = [tt for tt, before, after in zip(t[1:], preempted, preempted[1:]) if after > before]
        rate.plot(hits, [0] * len(hits), "|", color=color, ms=10, mew=1.5, clip_on=False,
                  label=f"{instance['name']}: a preemption")
    mem.plot(t, [s["held_bytes"] / MIB for s in samples], color="0.35", lw=1.2, ls=":",
             label="both together (held in the budget)")
    mem.axhline(budget_mib, color="black", lw=1.5, ls="--")
    mem.text(0.003, budget_mib, f" global budget {budget_mib:g} MiB", transform=mem.get_yaxis_transform(),
             va="bottom", ha="left", fontsize=9)
    mem.set_ylim(0, budget_mib * 1.18)
    mem.set_ylabel("KV cache memory mapped (MiB)")
    mem.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=9, frameon=False)
    mem.grid(axis="y", alpha=0.3)
    where = "the CPU (host backend)" if record["device"] == "cpu" else record["device"]
    mem.set_title(f"Two models on {where} under one global KV budget of {budget_mib:g} MiB: "
                  "the memory follows the load", pad=34, fontsize=12)
    rate.set_ylabel("tokens generated/s")
    rate.set_xlabel("time since the first phase began (s)")
    rate.set_ylim(bottom=0)
    rate.grid(axis="y", alpha=0.3)
    rate.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=9, frameon=False)
    rate.set_xlim(0, record["phases"][-1]["end_s"])
    fig.savefig(path, dpi=110, format="png")       # whatever the path ends in
    plt.close(fig)
