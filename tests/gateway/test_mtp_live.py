"""`agentgate serve --mtp 3` on the demo model (MTP layers distilled at init, issue 14), driven
with the openai SDK: the same greedy answers, whole and streamed, as a gateway without MTP, and
the workers' MTP counters on /metrics."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.live import LiveGateway, live_gateway

QUESTIONS = ["Say something about caches.", "Count: one, two, three,", "Hi!"]


@pytest.fixture(scope="module")
def mtp_gateway(demo_model_dir: Path) -> Iterator[LiveGateway]:
    with live_gateway(demo_model_dir, "--mtp", "3", backend="native") as live:
        yield live


def _answers(base_url: str, stream: bool) -> list[str]:
    out = []
    with openai.OpenAI(base_url=base_url, api_key="sk-mtp", max_retries=0, timeout=60) as c:
        for q in QUESTIONS:
            kwargs = {"model": "demo", "messages": [{"role": "user", "content": q}],
                      "max_tokens": 24, "temperature": 0}
            if stream:
                chunks = c.chat.completions.create(stream=True, **kwargs)
                out.append("".join(ch.choices[0].delta.content or "" for ch in chunks
                                   if ch.choices))
            else:
                out.append(c.chat.completions.create(**kwargs).choices[0].message.content or "")
    return out


def test_answers_equal_a_gateway_without_mtp(mtp_gateway: LiveGateway,
                                             native_gateway: LiveGateway) -> None:
    want = _answers(native_gateway.api_url, stream=False)
    assert _answers(mtp_gateway.api_url, stream=False) == want
    assert _answers(mtp_gateway.api_url, stream=True) == want
    assert any(want)


def test_the_workers_report_mtp_on_metrics(mtp_gateway: LiveGateway) -> None:
    _answers(mtp_gateway.api_url, stream=False)
    values: dict[str, float] = {}
    for _ in range(50):  # NOTE: LoadReports arrive with heartbeats
        with urllib.request.urlopen(mtp_gateway.base_url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        values = {s.name: s.value for f in text_string_to_metric_families(text)
                  for s in f.samples if s.name.startswith("agentgate_worker_mtp_")}
        if values.get("agentgate_worker_mtp_verify_steps_total"):
            break
        time.sleep(0.2)
    assert values["agentgate_worker_mtp_verify_steps_total"] > 0, values
    drafted = values["agentgate_worker_mtp_draft_tokens_total"]
    assert 0 < drafted <= 3 * values["agentgate_worker_mtp_verify_steps_total"]
    assert 0 <= values["agentgate_worker_mtp_accepted_tokens_total"] <= drafted
