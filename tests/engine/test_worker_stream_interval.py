"""``Generate.stream_interval_s``: a worker holds new tokens back for that long, so a short
answer arrives as one ``TokenDelta`` right before ``Finished``; 0 streams every step; a value out
of range is ``invalid_request``."""

import asyncio
import math

import pytest

from engine.protocol import Finished, Generate, SamplingSpec, TokenDelta
from gateway.dispatch import WorkerClient, WorkerError
from gateway.serve import WorkerProcess


@pytest.fixture(scope="module")
def worker(sim_worker: WorkerProcess) -> WorkerProcess:
    return sim_worker


def _run(worker: WorkerProcess, *requests: Generate) -> list[list[object]]:
    async def main() -> list[list[object]]:
        client = WorkerClient(worker.listen)
        await client.connect()
        try:
            async def collect(req: Generate) -> list[object]:
                try:
                    return [item async for item in client.generate(req)]
                except WorkerError as exc:
                    return [exc]
            return list(await asyncio.gather(*map(collect, requests)))
        finally:
            client.close()

    return asyncio.run(main())


def _generate(rid: str, interval_s: float, max_new_tokens: int = 12) -> Generate:
    return Generate(request_id=rid, input_ids=list(range(40)), stream_interval_s=interval_s,
                    sampling=SamplingSpec(max_new_tokens=max_new_tokens, temperature=0.0))


def test_held_tokens_come_as_one_delta(worker: WorkerProcess) -> None:
    [per_step] = _run(worker, _generate("per-step", 0.0))
    [held] = _run(worker, _generate("held", 5.0))
    deltas = [m for m in per_step if isinstance(m, TokenDelta)]
    assert len(deltas) > 1 and isinstance(per_step[-1], Finished), per_step
    [one] = [m for m in held if isinstance(m, TokenDelta)]
    assert isinstance(held[-1], Finished) and len(held) == 2, held
    assert len(one.token_ids) == sum(len(d.token_ids) for d in deltas) == 12
    assert held[-1].completion_tokens == 12  # type: ignore[attr-defined]


@pytest.mark.parametrize("interval_s", [-1.0, math.nan, 3600.0])
def test_out_of_range_interval_is_invalid_request(worker: WorkerProcess, interval_s: float) -> None:
    [[error]] = _run(worker, _generate("bad", interval_s))
    assert isinstance(error, WorkerError) and error.code == "invalid_request", error
    assert "stream_interval_s" in error.message
