"""What the demo's samples say about sharing, phase by phase: the part of the budget each
instance held once the phase settled, and how soon a newly loaded instance got its part."""

from __future__ import annotations

SETTLED_FROM = 0.5              # a phase's second half counts as settled
FIRST_PART = 0.25               # a newly loaded instance's first milestone, of the budget


def phase_figures(record: dict) -> list[dict]:
    """Per phase of ``record`` (the demo's JSON): ``label``; ``held``, each instance's mean
    mapped bytes over the phase's second half as a fraction of the budget (None without
    samples there); ``newly_loaded``, whether it has clients now and had none in the previous
    phase; ``reached_s``, for a newly loaded instance the seconds from the phase's start to its
    first sample holding FIRST_PART of the budget (None if it never did or was not newly loaded)."""
    budget = record["budget"]["bytes"]
    samples = record["samples"]
    figures = []
    previous = [0.0] * len(record["instances"])
    for phase in record["phases"]:
        start, end = phase["start_s"], phase["end_s"]
        within = [s for s in samples if start <= s["t_s"] < end]
        settled = [s for s in within if s["t_s"] >= start + SETTLED_FROM * (end - start)]
        figure = {"label": phase["label"], "held": [], "newly_loaded": [], "reached_s": []}
        for i, share in enumerate(phase["share"]):
            mapped = [s["instances"][i]["mapped_bytes"] for s in settled]
            newly_loaded = share > 0 and previous[i] == 0
            reached = next((s["t_s"] - start for s in within
                            if s["instances"][i]["mapped_bytes"] >= FIRST_PART * budget), None)
            figure["held"].append(sum(mapped) / len(mapped) / budget if mapped else None)
            figure["newly_loaded"].append(newly_loaded)
            figure["reached_s"].append(reached if newly_loaded else None)
        figures.append(figure)
        previous = phase["share"]
    return figures


def describe(record: dict) -> list[str]:
    """One line per phase: each instance's settled part of the budget, and how soon a newly
    loaded one held FIRST_PART of it."""
    names = [instance["name"] for instance in record["instances"]]
    lines = []
    for figure in phase_figures(record):
        parts = []
        for i, name in enumerate(names):
            held = figure["held"][i]
            text = f"{name} {'-' if held is None else f'{held:.0%}'}"
            if figure["newly_loaded"][i]:
                reached = figure["reached_s"][i]
                text += (f" (newly loaded, never held {FIRST_PART:.0%})" if reached is None else
                         f" (newly loaded, held {FIRST_PART:.0%} after {reached:.2f} s)")
            parts.append(text)
        lines.append(f"{figure['label']}: budget held over the second half: {', '.join(parts)}")
    return lines
