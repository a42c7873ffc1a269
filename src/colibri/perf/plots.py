"""Pictures of `colibri plan --plot` and `colibri bench --plot` (matplotlib, the `plots` extra).

* `placement_plot`: per layer, its page bytes pinned, streamed whole and read by rows, with the embedding and
  the head beside them: where the memory limit puts each layer's weights.
* `timeline_plot`: the streaming store's per-scope timeline of a run's first forward passes (the prompt's, then
  decode steps): for each pass a row of its scopes in order, each the wait for its pages (reads not done ahead)
  then its compute, and under it the bytes each scope read on demand.
"""

from __future__ import annotations

from pathlib import Path

from colibri.core.errors import InputError
from colibri.perf.predict import Layout

MIB = 1 << 20
COLORS = {"pinned": "#2f4b7c", "streamed": "#e9c46a", "by_rows": "#a05195", "wait": "#d1495b",
          "compute": "#2a9d8f"}


def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise InputError("--plot needs matplotlib: pip install 'colibri[plots]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    return plt


def placement_plot(lay: Layout, out: str | Path) -> Path:
    """Stacked bars of page bytes (MiB) per layer and tier; returns the file written."""
    plt = pyplot()
    groups = {"pinned": lay.placement.pinned, "streamed": lay.placement.streamed, "by_rows": lay.placement.by_rows}
    n = lay.args.num_layers
    names = ["emb"] + [str(i) for i in range(n)] + ["head"]
    bars = {g: [0.0] * (n + 2) for g in groups}
    for group, ids in groups.items():
        for pid in ids:
            page = lay.pages[pid]
            col = 0 if page.kind == "embedding" else n + 1 if page.layer is None else page.layer + 1
            bars[group][col] += page.nbytes / MIB
    fig, ax = plt.subplots(figsize=(max(6.0, 0.25 * (n + 2) + 2), 3.6))
    bottom = [0.0] * (n + 2)
    for group, values in bars.items():
        if any(values):
            ax.bar(range(n + 2), values, bottom=bottom, color=COLORS[group], label=group.replace("_", " "))
            bottom = [b + v for b, v in zip(bottom, values)]
    step = max(1, (n + 2) // 24)
    ax.set_xticks(range(0, n + 2, step), names[::step], fontsize=8)
    ax.set_xlabel("layer")
    ax.set_ylabel("MiB")
    limit = lay.memory_limit_bytes
    ax.set_title(f"{lay.model.name}: placement under " + (f"--memory-limit {limit / MIB:.0f} MiB" if limit else
                                                           "no memory limit"), fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return Path(out)


def timeline_plot(timeline: list[dict], out: str | Path, title: str = "") -> Path:
    """Per pass, its scopes' wait (reads not done ahead) and compute laid end to end, with the bytes each read on
    demand below; returns the file written."""
    if not timeline:
        raise InputError("no per-layer timeline to plot: nothing streamed (all weights were resident); lower"
                         " --memory-limit so that pages are read from disk")
    plt = pyplot()
    passes = sorted({e["pass"] for e in timeline})
    fig, (top, low) = plt.subplots(2, 1, figsize=(10, 1.2 + 0.6 * len(passes) + 2.2),
                                   gridspec_kw={"height_ratios": [max(1, len(passes)), 2]})
    x = 0.0
    demand_x, demand = [], []
    for p in passes:
        t = 0.0
        for e in (e for e in timeline if e["pass"] == p):
            y = passes.index(p)
            edge = dict(height=0.6, edgecolor="white", linewidth=0.3)  # the scopes' boundaries
            if e["wait_ms"] > 0:
                top.barh(y, e["wait_ms"], left=t, color=COLORS["wait"], **edge)
            top.barh(y, e["compute_ms"], left=t + e["wait_ms"], color=COLORS["compute"], **edge)
            t += e["wait_ms"] + e["compute_ms"]
            demand_x.append(x)
            demand.append(e["demand_bytes"] / MIB)
            x += 1
    top.set_yticks(range(len(passes)), [f"pass {p}" + (" (prompt)" if p == passes[0] else "") for p in passes])
    top.invert_yaxis()
    top.set_xlabel("ms from the pass's start")
    from matplotlib.patches import Patch
    top.legend(handles=[Patch(color=COLORS["wait"], label="wait for reads"),
                        Patch(color=COLORS["compute"], label="compute")], fontsize=8, loc="lower right")
    top.set_title(title or "per-scope timeline of the first forward passes", fontsize=10)
    low.bar(demand_x, demand, color=COLORS["streamed"], width=1.0)
    low.set_xlabel("scope, in order (all passes)")
    low.set_ylabel("MiB read on demand")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return Path(out)
