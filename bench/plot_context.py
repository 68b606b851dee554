"""Plot cold TTFT, warm TTFT and single-stream inter-token latency against context length,
one line per server, from the JSON lines ``bench/context_sweep.sh`` wrote (labels
``<server>/ttft/<context>`` and ``<server>/decode/<context>``); prints the table it plots and
each server's ratio to the first one.

    .venv/bin/python bench/plot_context.py /tmp/context-sweep.jsonl --out docs/img/context.png
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from plot_serving import save_figure

from prefixcache.engine.model.progress import progress_iter

PANELS = (  # (label kind, JSON key, title)
    ("ttft", "A_cold_ms", "cold TTFT (ms)"),
    ("ttft", "B_warm_ms", "warm TTFT, context - 100 cached (ms)"),
    ("decode", "itl_mean_ms", "one stream, inter-token latency (ms)"),
)


def read(paths: list[Path]) -> dict[str, dict[str, dict[int, dict]]]:
    """server -> kind -> context -> the record (the last one wins)."""
    series: dict[str, dict[str, dict[int, dict]]] = defaultdict(lambda: defaultdict(dict))
    for path in progress_iter(paths, "result files"):
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            r = json.loads(line)
            server, kind, context = str(r["label"]).split("/")
            series[server][kind][int(context)] = r
    return series


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("results", type=Path, nargs="+", help="JSON-lines files from the sweep")
    ap.add_argument("--out", type=Path, default=Path("docs/img/context.png"))
    ap.add_argument("--title", default="")
    args = ap.parse_args()
    series = read(args.results)
    servers = list(series)
    first = servers[0]
    for kind, key, title in PANELS:
        print(title)
        for server in servers:
            row = series[server][kind]
            cells = []
            for c in sorted(row):
                ours, base = row[c][key], series[first][kind].get(c, {}).get(key)
                ratio = f" ({ours / base:.2f}x)" if base and server != first else ""
                cells.append(f"{c}: {ours:.1f}{ratio}")
            print(f"  {server}: " + ", ".join(cells))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4))
    for ax, (kind, key, title) in zip(axes, PANELS, strict=True):
        for server in servers:
            row = series[server][kind]
            xs = sorted(row)
            ax.plot(xs, [row[c][key] for c in xs], marker="o", label=server)
        ax.set_xlabel("context (tokens)")
        ax.set_title(title)
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    save_figure(fig, args.out, args.title)


if __name__ == "__main__":
    main()
