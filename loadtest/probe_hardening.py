"""Fault-and-abuse probe for issue 8: before/after figures for items 1-3 and 7-13.

    python loadtest/probe_hardening.py [--items 1,2,3,7,8,9,10,11,12,13] [--json out.json]

Starts real processes on 127.0.0.1 only (``python -m gateway.cli serve``, sim workers via
``python -m engine.worker``, ``redis-server``), measures, prints one line per item, and kills
everything it started. Each item runs in its own process group with a time box: a hang is
reported as ``hung > N s`` with whatever figures it had by then. Uses only flags that exist in
both the pre-fix tree (bef7ef4) and later ones, so the same script measures both: run it with
``PYTHONPATH=<tree>`` (and cwd there) to measure another checkout than the installed one.

Figures are wall-clock times on whatever box runs it; on a shared 2-core box they are noisy, so
read them as "seconds vs. a minute", not to the millisecond.

This file is the driver (arguments, one time-boxed process group per item); the process and
HTTP helpers and the items themselves live in ``loadtest/probe/``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from probe.items_processes import (
    item7_sigterm,
    item8_worker_kill,
    item9_same_port_restart,
    item10_late_worker,
)
from probe.items_redis import item11_redis_outage, item12_redis_dies_at_turn_end
from probe.items_requests import (
    item1_grammar,
    item2_huge_bodies,
    item3_stop_strings,
    item13_backpressure,
)
from probe.procs import ITEM_BOX_S, MODEL, Ctx, Procs

ALL_ITEMS = (1, 2, 3, 7, 8, 9, 10, 11, 12, 13)

ITEMS: dict[int, Callable[[Ctx], str]] = {
    1: item1_grammar, 2: item2_huge_bodies, 3: item3_stop_strings, 7: item7_sigterm,
    8: item8_worker_kill, 9: item9_same_port_restart, 10: item10_late_worker,
    11: item11_redis_outage, 12: item12_redis_dies_at_turn_end, 13: item13_backpressure,
}


# --- driver ----------------------------------------------------------------------------------


def run_one(item: int, root: Path, model_dir: Path, out_path: Path) -> int:
    """Child-process entry: run one item, write its figures and summary line to ``out_path``."""
    procs = Procs(root)
    ctx = Ctx(procs, model_dir, out_path)
    try:
        ctx.rec(line=ITEMS[item](ctx))
    except Exception as e:  # noqa: BLE001 - reported as the item's line
        ctx.rec(line=f"could not run: {type(e).__name__}: {str(e)[:600]}")
    finally:
        procs.close()
    return 0


def run_item(item: int, root: Path, model_dir: Path) -> dict[str, Any]:
    """Run ``item`` in its own process group, killed (all of it) after its time box."""
    item_root = root / f"item{item}"
    item_root.mkdir()
    out_path = item_root / "result.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_one", str(item),
           "--_root", str(item_root), "--model", str(model_dir)]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=(item_root / "driver.log").open("wb"), stderr=subprocess.STDOUT)
    hung = False
    try:
        proc.wait(timeout=ITEM_BOX_S[item])
    except subprocess.TimeoutExpired:
        hung = True
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    figures = json.loads(out_path.read_text()) if out_path.exists() else {}
    figures["elapsed_s"] = round(time.monotonic() - start, 1)
    if hung:
        figures["line"] = f"hung > {ITEM_BOX_S[item]} s (partial: {figures})"
    elif "line" not in figures:
        log = (item_root / "driver.log").read_text(errors="replace")[-600:]
        figures["line"] = f"could not run (rc={proc.returncode}): {log}"
    return figures


def ensure_model(root: Path, given: Path | None) -> Path:
    """The model dir, named ``demo``: later trees serve a model under its directory's name
    (issue 8 item 16) and refuse others, earlier ones accept any name."""
    model_dir = root / MODEL
    if given is not None:
        model_dir.symlink_to(given.resolve(), target_is_directory=True)
        return model_dir
    subprocess.run([sys.executable, "-m", "gateway.cli", "model", "init", str(model_dir)],
                   check=True, stdout=subprocess.DEVNULL, timeout=300)
    return model_dir


def tree_info() -> dict[str, Any]:
    """Which checkout is measured: subprocesses inherit PYTHONPATH, so they import the same."""
    import engine
    import gateway

    tree = Path(gateway.__file__).resolve().parent.parent
    rev = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "-uno"],
                           capture_output=True, text=True).stdout.strip()
    return {"tree": str(tree), "commit": rev + ("+dirty" if dirty else ""),
            "engine": str(Path(engine.__file__).resolve().parent),
            "loadavg": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", default=",".join(map(str, ALL_ITEMS)))
    parser.add_argument("--json", type=Path, help="write all figures here")
    parser.add_argument("--model", type=Path, help="model dir (default: the demo model, written "
                        "fresh); served as 'demo'")
    parser.add_argument("--_one", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--_root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._one is not None:
        return run_one(args._one, args._root, args.model, args._root / "result.json")
    items = [int(i) for i in args.items.split(",") if i.strip()]
    unknown = set(items) - set(ITEMS)
    if unknown:
        parser.error(f"--items: no such item(s) {sorted(unknown)}; known: {list(ITEMS)}")
    info = tree_info()
    print(f"probe_hardening: tree {info['tree']} @ {info['commit']} (engine from "
          f"{info['engine']}), loadavg "
          f"{info['loadavg'][0]:.1f}, {info['date']}", flush=True)
    results: dict[str, Any] = {"meta": info}
    with tempfile.TemporaryDirectory(prefix="probe-hardening-") as tmp:
        root = Path(tmp)
        model_dir = ensure_model(root, args.model)
        for item in items:
            figures = run_item(item, root, model_dir)
            results[str(item)] = figures
            print(f"item {item}: {figures['line']}  [{figures['elapsed_s']} s]", flush=True)
            if args.json:
                args.json.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
