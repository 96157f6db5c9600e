"""The summary of one ``locustfile.py`` run, from Locust's CSV files (``--csv PREFIX``): per kind
of client, turns, turns/s, tok/s, TTFT and ITL p50/p99, the turn's own p50/p99, failures; then
the failures by kind, any exception, and one summary line. ``locust.sh`` prints it at the end.

    python loadtest/locust_report.py OUT/locust      # reads OUT/locust_stats.csv, ...

NOTE: ``TTFT`` and ``ITL`` rows are measurements, not requests: Locust's own "Aggregated" row
(and its console total) counts them as requests; req/s here leaves them out. Percentiles are
Locust's, rounded as it stores them (to 1 ms under 100 ms, 10 ms under 1 s, 100 ms above).
"""

import csv
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

KINDS = ("rest", "sse", "ws", "chat")
MEASUREMENT_TYPES = ("TTFT", "ITL")
_NAMED_FAILURE = re.compile(r"""RequestFailure\((['"])(.*)\1\)""")


class StatsRow(NamedTuple):
    request_type: str
    name: str
    num_requests: int
    num_failures: int
    requests_per_s: float
    avg_content_size: float
    p50_ms: float | None
    p99_ms: float | None


class Failure(NamedTuple):
    request_type: str
    name: str
    error: str
    occurrences: int


def read_stats(prefix: str | Path) -> dict[tuple[str, str], StatsRow]:
    """``PREFIX_stats.csv`` by (type, name), without Locust's "Aggregated" row."""
    rows = {}
    for row in _read_csv(f"{prefix}_stats.csv"):
        if row["Name"] == "Aggregated":
            continue
        stats = StatsRow(row["Type"], row["Name"], int(row["Request Count"]),
                         int(row["Failure Count"]), float(row["Requests/s"]),
                         float(row["Average Content Size"]), _ms(row["50%"]), _ms(row["99%"]))
        rows[stats.request_type, stats.name] = stats
    return rows


def read_failures(prefix: str | Path) -> list[Failure]:
    """``PREFIX_failures.csv``; an error the locustfile named (``RequestFailure('HTTP 429
    ...')`` in the CSV, Locust keeps the exception's repr) is given by its name alone."""
    return [Failure(row["Method"], row["Name"], _unwrap(row["Error"]), int(row["Occurrences"]))
            for row in _read_csv(f"{prefix}_failures.csv")]


def read_exceptions(prefix: str | Path) -> list[str]:
    path = Path(f"{prefix}_exceptions.csv")
    if not path.exists():
        return []
    return [f"{row['Count']} x {row['Message']}" for row in _read_csv(path)]


def report(prefix: str | Path) -> str:
    """The whole summary of the run whose CSV files start with ``prefix``, as text."""
    stats = read_stats(prefix)
    lines = ["| kind | turns | turns/s | tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms "
             "| turn p50 / p99 ms | failed turns |", "| --- |" + " ---: |" * 7]
    lines += [_kind_line(kind, stats) for kind in KINDS if ("TURN", kind) in stats]
    requests = [s for s in stats.values() if s.request_type not in MEASUREMENT_TYPES]
    failures = read_failures(prefix)
    lines += ["", f"requests: {sum(s.num_requests for s in requests)} "
              f"({sum(s.requests_per_s for s in requests):.2f} req/s, TTFT / ITL rows not "
              f"counted), failed: {sum(s.num_failures for s in requests)}", "failures by kind:"]
    lines += [f"  {f.request_type} {f.name}: {f.error} x {f.occurrences}" for f in failures]
    lines += ["  none"] if not failures else []
    lines += [f"exception in the locustfile: {e}" for e in read_exceptions(prefix)]
    return "\n".join([*lines, _summary_line(stats, requests, failures)])


def _kind_line(kind: str, stats: dict[tuple[str, str], StatsRow]) -> str:
    turn = stats["TURN", kind]
    ttft, itl = stats.get(("TTFT", kind)), stats.get(("ITL", kind))
    tok_s = turn.requests_per_s * turn.avg_content_size  # NOTE: content size = tokens (TURN)
    return (f"| {kind} | {turn.num_requests} | {turn.requests_per_s:.2f} | {tok_s:.0f} | "
            f"{_pair(ttft)} | {_pair(itl)} | {_pair(turn)} | {turn.num_failures} |")


def _summary_line(stats: dict[tuple[str, str], StatsRow], requests: list[StatsRow],
                  failures: list[Failure]) -> str:
    turns = [s for s in stats.values() if s.request_type == "TURN"]
    tok_s = sum(s.requests_per_s * s.avg_content_size for s in turns)
    worst = {t: _worst([s for s in stats.values() if s.request_type == t])
             for t in MEASUREMENT_TYPES}
    return (f"summary: {sum(s.requests_per_s for s in requests):.2f} req/s, "
            f"{sum(s.requests_per_s for s in turns):.2f} turns/s, {tok_s:.0f} tok/s, "
            f"TTFT p50/p99 {worst['TTFT']}, ITL p50/p99 {worst['ITL']} (the worst kind's), "
            f"{sum(f.occurrences for f in failures)} failures")


def _pair(row: StatsRow | None) -> str:
    if row is None or row.p50_ms is None:
        return "-"
    return f"{_fmt(row.p50_ms)} / {_fmt(row.p99_ms)}"


def _worst(rows: Iterable[StatsRow]) -> str:
    """The highest p50 and the highest p99 over ``rows`` (of different kinds, maybe)."""
    p50s = [r.p50_ms for r in rows if r.p50_ms is not None]
    p99s = [r.p99_ms for r in rows if r.p99_ms is not None]
    return f"{_fmt(max(p50s))}/{_fmt(max(p99s))} ms" if p50s and p99s else "-"


def _unwrap(error: str) -> str:
    match = _NAMED_FAILURE.fullmatch(error)
    return match[2] if match else error


def _fmt(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.0f}"


def _ms(cell: str) -> float | None:
    return None if cell in ("", "N/A") else float(cell)


def _read_csv(path: str | Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python loadtest/locust_report.py CSV_PREFIX")
    print(report(sys.argv[1]))


if __name__ == "__main__":
    main()
