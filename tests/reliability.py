"""Reliability records: the fault tests write what they injected and what clients saw, and
`make reliability` renders them into RELIABILITY.md (python -m tests.reliability)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOG = Path(os.environ.get("RELIABILITY_LOG", ROOT / "results" / "reliability.jsonl"))


def record(scenario: str, injected: str, clients_saw: dict[str, int] | str, recovery_s: float | None = None,
           note: str = "", at: str | None = None) -> None:
    """Append one scenario's outcome (called by the tests, after their assertions passed); `at`: when
    it ran, if not now."""
    LOG.parent.mkdir(parents=True, exist_ok=True)
    entry = {"scenario": scenario, "injected": injected, "clients_saw": clients_saw,
             "recovery_s": recovery_s, "note": note, "at": at or time.strftime("%Y-%m-%d %H:%M")}
    with LOG.open("a") as fh:
        fh.write(json.dumps(entry) + "\n")


def render(entries: list[dict]) -> str:
    lines = [
        "# Reliability",
        "",
        "Produced by `make reliability` from the fault tests' own records (`tests/reliability.py`); every row",
        "is a test against the real service on loopback (Ray Serve, onnxruntime, all-MiniLM-L6-v2) that passed,",
        "unless its notes say its check failed.",
        "",
        "| scenario | injected | what clients saw | recovery | notes |",
        "| --- | --- | --- | --- | --- |",
    ]
    latest: dict[str, dict] = {}
    for e in entries:  # the newest record of each scenario
        latest[e["scenario"]] = e
    for e in latest.values():
        saw = e["clients_saw"]
        if isinstance(saw, dict):
            saw = ", ".join(f"{k}: {v}" for k, v in sorted(saw.items()))
        recovery = e.get("recovery") or (f"{e['recovery_s']:.1f} s" if e.get("recovery_s") is not None else "n/a")
        lines.append(f"| {e['scenario']} | {e['injected']} | {saw} | {recovery} | {e.get('note', '')} |")
    when = max((e["at"] for e in latest.values()), default="")
    lines += ["", f"Last run: {when}, on a 2-core x86_64 machine without GPU.", ""]
    return "\n".join(lines)


def earlier_rows(text: str) -> list[dict]:
    """The rows of an earlier RELIABILITY.md as entries (their cells as written, the run's date as `at`):
    scenarios this run did not repeat (the 10-minute soak, make containers' cluster on another machine)
    keep their last measured row instead of vanishing."""
    when = next((line.split("Last run: ", 1)[1].split(",", 1)[0] for line in text.splitlines()
                 if line.startswith("Last run: ")), "")
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if not line.startswith("| ") or len(cells) != 5 or cells[0] in ("scenario", "---"):
            continue
        scenario, injected, saw, recovery, note = cells
        if when and "(run of " not in note:  # said once, so that a row kept twice keeps its first date
            note = f"{note} (run of {when})".strip()
        rows.append({"scenario": scenario, "injected": injected, "clients_saw": saw, "recovery": recovery,
                     "note": note, "at": when})
    return rows


def main(argv: list[str]) -> int:
    target = Path(argv[0]) if argv else ROOT / "RELIABILITY.md"
    if not LOG.exists():
        print(f"no records at {LOG}: run the reliability tests first", file=sys.stderr)
        return 1
    entries = [json.loads(line) for line in LOG.read_text().splitlines() if line.strip()]
    if target.exists():  # newest first wins in render(): earlier rows go before this run's records
        entries = earlier_rows(target.read_text()) + entries
    target.write_text(render(entries))
    print(f"wrote {target} ({len({e['scenario'] for e in entries})} scenarios)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
