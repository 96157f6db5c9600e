"""The pure parts of mid-stream migration (``gateway.attempts``): the resumed request, the
``Finished`` the client sees, and a stream that its lost worker had in fact finished."""

from engine.protocol import Finished, Generate, SamplingSpec
from gateway.attempts import already_done, as_original, resume_request

REQUEST = Generate(request_id="r", input_ids=[1, 2, 3, 4], cache_salt="t", session_id="s",
                   sampling=SamplingSpec(max_new_tokens=10, seed=3, stop_token_ids=[9]))


def test_the_resumed_request_carries_its_output_and_what_is_left() -> None:
    wire = resume_request(REQUEST, [5, 6, 7], "r.retry1")
    assert wire.input_ids == [1, 2, 3, 4, 5, 6, 7] and wire.request_id == "r.retry1"
    assert wire.sampling.max_new_tokens == 7 and wire.sampling.resumed_tokens == 3
    assert (wire.sampling.seed, wire.cache_salt, wire.session_id) == (3, "t", "s")
    assert REQUEST.input_ids == [1, 2, 3, 4]  # NOTE: the original is untouched
    again = resume_request(wire, [8], "r.retry2")  # NOTE: a resumed request resumed again
    assert again.sampling.resumed_tokens == 4 and again.sampling.max_new_tokens == 6


def test_the_client_sees_its_own_prompt_and_every_token() -> None:
    item = Finished(request_id="r.retry1", finish_reason="stop", prompt_tokens=7,
                    completion_tokens=2, cached_tokens=6, cached_tokens_device=6)
    seen = as_original(item, REQUEST, 3)
    assert (seen.prompt_tokens, seen.completion_tokens) == (4, 5)
    assert seen.cached_tokens == seen.cached_tokens_device == 4 and seen.finish_reason == "stop"


def test_a_stream_its_worker_had_finished_is_not_sent_again() -> None:
    assert already_done(REQUEST, [5, 6]) is None
    stopped = already_done(REQUEST, [5, 9])
    assert stopped is not None and stopped.finish_reason == "stop"
    assert (stopped.prompt_tokens, stopped.completion_tokens) == (4, 2)
    spent = already_done(REQUEST, list(range(10, 20)))
    assert spent is not None and spent.finish_reason == "length"
