"""Issue 8, items 1 and 7 on one sim worker: does a huge grammar stall it, and do requests of a
client that vanished keep running?

    python loadtest/probe_worker_stalls.py [--properties 7000] [--gone-wait-s 30]

1. One client sends a JSON schema of PROPERTIES optional properties (~200 kB at 7,000); another
   heartbeats (GetLoad every 0.2 s) and runs 5 short requests meanwhile.
2. A client starts a long generation and closes its socket; GetLoad shows how long it runs on.
Ends with one summary line. Works against any checkout (PYTHONPATH=that tree).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import zmq

from engine.models.checkpoint import DEMO_CONFIG
from engine.protocol import (
    Generate,
    GetLoad,
    LoadReport,
    SamplingSpec,
    decode_worker,
    decode_worker_items,
    encode,
)
from engine.sampling_params import StructuredSpec
from gateway.serve import spawn_worker
from gateway.tokenizer import write_demo_tokenizer

PROMPT = [72, 105, 33, 10]


def dealer(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def generate(sock: zmq.Socket, rid: str, **sampling: object) -> None:
    sock.send(encode(Generate(request_id=rid, input_ids=PROMPT, sampling=SamplingSpec(**sampling))))


def load(sock: zmq.Socket) -> tuple[float, LoadReport]:
    start = time.monotonic()
    sock.send(encode(GetLoad()))
    assert sock.poll(60_000), "no LoadReport within 60 s"
    return time.monotonic() - start, decode_worker(sock.recv())


def probe_grammar(endpoint: str, num_properties: int) -> str:
    slow, other, beat = dealer(endpoint), dealer(endpoint), dealer(endpoint)
    props = {f"p{i}": {"type": "string"} for i in range(num_properties)}
    schema = json.dumps({"type": "object", "properties": props})
    start = time.monotonic()
    generate(slow, "huge", structured=StructuredSpec(json_schema=schema), max_new_tokens=4)
    for i in range(5):
        generate(other, f"plain-{i}", max_new_tokens=8)
    beats: list[float] = []
    ended: dict[str, str] = {}
    while "huge" not in ended and time.monotonic() - start < 120:
        beats.append(load(beat)[0])
        for sock in (slow, other):
            while sock.poll(0):
                for msg in decode_worker_items(sock.recv()):
                    if type(msg).__name__ in ("Finished", "ErrorReply"):
                        ended[msg.request_id] = getattr(msg, "code", None) or msg.finish_reason
        time.sleep(0.2)
    plain = sum(ended.get(f"plain-{i}") == "length" for i in range(5))
    return (f"schema {len(schema) // 1000} kB -> {ended.get('huge')} after "
            f"{time.monotonic() - start:.1f} s, heartbeat max {max(beats):.2f} s, "
            f"others finished {plain}/5")


def probe_gone_client(endpoint: str, wait_s: float) -> str:
    gone, watch = dealer(endpoint), dealer(endpoint)
    generate(gone, "long", max_new_tokens=6000, ignore_eos=True)
    time.sleep(0.5)
    gone.close()
    start = time.monotonic()
    while load(watch)[1].num_running > 0 and time.monotonic() - start < wait_s:
        time.sleep(0.25)
    running = load(watch)[1].num_running
    return f"gone client's request {'still running' if running else 'dropped'} after " \
           f"{time.monotonic() - start:.1f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--properties", type=int, default=7000)
    parser.add_argument("--gone-wait-s", type=float, default=30.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(DEMO_CONFIG))
        write_demo_tokenizer(tmp)
        worker = spawn_worker(model_dir=Path(tmp), backend="sim", worker_id="probe")
        try:
            grammar = probe_grammar(worker.listen, args.properties)
            gone = probe_gone_client(worker.listen, args.gone_wait_s)
        finally:
            worker.stop()
    print(f"{grammar}; {gone}")


if __name__ == "__main__":
    main()
