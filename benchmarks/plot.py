"""Plot throughput and p99 latency against concurrency from `make bench` output (results/bench.json).

    python -m benchmarks.plot [results/bench.json] [docs/performance.png]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt  # noqa: E402


def plot(data: dict, out: Path) -> Path:
    """Two panels: texts/s and p99 ms vs concurrency of single-text requests (fp32), by ingress and
    batching on/off, with the in-process references as horizontal lines."""
    rows = data["rows"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    series: dict[str, list[tuple[int, float, float]]] = {}
    for r in rows:
        if r.get("per_request") == 1 and not r.get("short") and not r.get("mixed") and r.get("precision") == "fp32":
            label = (f"single texts, {r['peer']} (peer)" if r.get("peer")
                     else f"single texts, {r['ingress']}, batching {'on' if r['batching'] else 'off'}")
            series.setdefault(label, []).append((r["concurrency"], r["texts_s"], r["p99"]))
    for (label, points), style in zip(sorted(series.items()), ("o-", "s--", "^-.", "d:", "x-", "v--"), strict=False):
        conc, tput, p99 = zip(*sorted(points), strict=True)
        left.plot(conc, tput, style, label=label)
        right.plot(conc, p99, style, label=label)
    for r in rows:
        if r["engine"].startswith("in-process"):
            left.axhline(r["texts_s"], linestyle=":", linewidth=1, color="gray")
            left.annotate(r["engine"].removeprefix("in-process "), (1, r["texts_s"]), fontsize=7, color="gray",
                          va="bottom")
    left.set(xscale="log", xlabel="concurrent clients", ylabel="texts/s", title="Throughput")
    right.set(xscale="log", xlabel="concurrent clients", ylabel="p99 latency (ms)", title="p99 latency")
    for ax in (left, right):
        ax.set_xticks([1, 2, 4, 8, 16, 32], labels=["1", "2", "4", "8", "16", "32"])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"all-MiniLM-L6-v2, {data['machine']}, {data['date']}", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def main(argv: list[str]) -> int:
    source = Path(argv[0]) if argv else Path("results/bench.json")
    target = Path(argv[1]) if len(argv) > 1 else Path("docs/performance.png")
    print(f"wrote {plot(json.loads(source.read_text()), target)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
