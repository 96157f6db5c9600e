"""Worker processes sharing an L3 GCache (issue 12): a session's next turn on another worker
process resumes from L3 with identical greedy tokens; Redis standalone and Redis Cluster; a
Redis killed mid-run turns lookups into misses, never failed requests."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from engine.llm import LLM
from engine.protocol import Finished, GetLoad, LoadReport
from engine.sampling_params import SamplingParams
from gateway.serve import WorkerProcess, spawn_worker
from tests.engine.redis_cluster import RedisClusterInfo, redis_cluster  # noqa: F401 (fixture)
from tests.engine.worker_harness import Client
from tests.sessions.redis_server import redis_server

PAGE = 4


@contextmanager
def _workers(n: int, gcache: str, model_dir: Path | None = None) -> Iterator[list[WorkerProcess]]:
    backend = "native" if model_dir is not None else "sim"
    args = ["--gcache", gcache, "--page-size", str(PAGE), "--kv-budget-mb", "8",
            "--gcache-wait-s", "5", "--cost", "zero"]
    procs: list[WorkerProcess] = []
    try:
        for i in range(n):
            procs.append(spawn_worker(model_dir=model_dir, backend=backend,
                                      worker_id=f"gc{i}", extra_args=args))
        yield procs
    finally:
        for proc in procs:
            proc.stop()


def _turn(client: Client, request_id: str, prompt: list[int], new: int) -> tuple[list[int],
                                                                                 Finished]:
    client.generate(request_id, prompt, max_new_tokens=new, temperature=0.0, ignore_eos=True)
    deltas, end = client.collect(request_id)
    assert isinstance(end, Finished), end
    return [t for d in deltas for t in d.token_ids], end


def test_native_session_resumes_on_another_worker_process(tiny_model_dir, tmp_path, connect):
    """Turns 1-2 on worker A, turn 3 on worker B (which never saw the session): B's prompt is
    served from the shared file GCache, and every greedy token equals an uncached engine's."""
    plain = LLM(tiny_model_dir, dtype="float32", device="cpu", page_size=PAGE,
                enable_prefix_cache=False)
    rng = random.Random(7)
    msgs = [[rng.randrange(1, 300) for _ in range(9 + 4 * t)] for t in range(3)]
    with _workers(2, f"file:{tmp_path / 'gc'}", tiny_model_dir) as (a, b):
        ca, cb = connect(a.listen), connect(b.listen)
        history: list[int] = []
        got, finished = [], []
        written = 0
        for t, msg in enumerate(msgs):
            history += msg
            client = ca if t < 2 else cb
            tokens, end = _turn(client, f"turn{t}", history, 5)
            got.append(tokens)
            finished.append(end)
            history += tokens
            if t < 2:
                # NOTE: the write-through is asynchronous (one job per finished request): B
                # may look only once A's job for this turn is confirmed
                _wait_written(ca, written + 1)
                written = _written(ca)
    want = []
    history = []
    for msg in msgs:
        history += msg
        [out] = plain.generate([history], SamplingParams(max_new_tokens=5, temperature=0.0,
                                                         ignore_eos=True))
        want.append(list(out.token_ids))
        history += out.token_ids
    assert got == want
    last = finished[2]
    # NOTE: B never computed any of it: every cached token came from L3
    assert last.cached_tokens >= last.prompt_tokens - len(msgs[2]) - 2 * PAGE, last
    assert last.cached_tokens_storage == last.cached_tokens, last


def _written(client: Client) -> int:
    client.send(GetLoad())
    while not isinstance(msg := client.recv(), LoadReport):
        pass
    return msg.storage_written_pages


def _wait_written(client: Client, at_least: int, timeout_s: float = 10.0) -> None:
    """Until the worker's write-through (asynchronous) confirmed ``at_least`` pages."""
    deadline = time.monotonic() + timeout_s
    while (n := _written(client)) < at_least:
        assert time.monotonic() < deadline, f"{n} pages written, want {at_least}"
        time.sleep(0.05)


def _prompt(seed: int, n: int = 41) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 300) for _ in range(n)]


def test_sim_workers_share_redis_and_survive_its_death(tmp_path, connect):
    """Two sim workers on one Redis: B resumes what A wrote. Redis killed: every request still
    finishes (cold, a miss); restarted: L3 works again."""
    with redis_server(tmp_path) as server, _workers(2, server.url + "?timeout_s=0.2") as (a, b):
        ca, cb = connect(a.listen), connect(b.listen)
        first = _prompt(1)
        out, _ = _turn(ca, "a1", first, 3)
        _wait_written(ca, 10)
        _, end = _turn(cb, "b1", [*first, *out, 5, 6, 7], 2)
        assert end.cached_tokens >= 40 and end.cached_tokens_storage == end.cached_tokens, end
        server.kill()
        for i in range(3):
            prompt = _prompt(10 + i)
            out, end_a = _turn(ca, f"a-down{i}", prompt, 3)
            _, end_b = _turn(cb, f"b-down{i}", [*prompt, *out, 1, 2], 2)
            assert end_a.finish_reason == end_b.finish_reason == "length"
            assert end_b.cached_tokens == 0, "a hit while Redis is down"
        server.start()
        second = _prompt(99)
        before = _written(ca)
        out, _ = _turn(ca, "a2", second, 3)
        _wait_written(ca, before + 10)
        _, end = _turn(cb, "b2", [*second, *out, 8], 1)
        assert end.cached_tokens_storage >= 40, end


def test_sim_workers_share_a_redis_cluster(redis_cluster: RedisClusterInfo, connect):  # noqa: F811
    with _workers(2, redis_cluster.spec) as (a, b):
        ca, cb = connect(a.listen), connect(b.listen)
        prompt = _prompt(5)
        out, _ = _turn(ca, "a1", prompt, 3)
        _wait_written(ca, 10)
        _, end = _turn(cb, "b1", [*prompt, *out, 4], 1)
        assert end.cached_tokens_storage >= 40, end
