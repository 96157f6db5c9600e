"""Predicted time to first token on a worker, from the step cost model it announced
(``Welcome.cost``, ``engine.cost.CostModel``) and the work the router knows is ahead.

The engine's scheduler (``engine.scheduler``) runs steps of at most ``max_batched_tokens``
tokens: one for each decoding request first, then prefill chunks in arrival order (equal
priorities). A new request's first token comes out of the step that computes its last prompt
token, so, with ``Q`` uncached prompt tokens queued or prefilling ahead of it, ``U`` of its own,
``D`` requests decoding and ``B = max_batched_tokens``::

    b      = max(1, B - D)                     prefill tokens per step
    steps  = ceil((Q + U) / b)
    ttft   = steps * (step_overhead_s + decode_s_per_token * D)
             + prefill_s_per_token * (Q + U)
             + attn_s_per_qk * (qk_ahead + qk_own)

``qk_own`` is the (query, key) pairs of the request's own chunks (``prefill_qk_pairs``: chunk
``i`` of ``q_i`` tokens after ``c_i`` computed ones attends to ``c_i + q_i`` keys, as
``engine.sim`` counts them); ``qk_ahead`` the same for the work ahead, summed at dispatch.

(A step whose prefill is a single token is priced as a decode, as the sim does.) With nothing
ahead (Q = 0, D = 0) this is exactly the sim's arithmetic (tests/gateway/
test_routing_cost.py runs the real engine to check). With load it is an estimate: it ignores the
decode attention term (context lengths of decoding requests are not tracked), requests ahead that
start decoding while this one waits (each adds a token per step), and prefills the tracker still
counts whole although they are partly done (the tracker releases them at their first token).
"""

from __future__ import annotations

from engine.cost import CostModel


def prefill_qk_pairs(cached_tokens: int, uncached_tokens: int, chunk_tokens: int) -> int:
    """(query, key) pairs attended by a prefill of ``uncached_tokens`` after ``cached_tokens``,
    in chunks of ``chunk_tokens`` (closed form of the sim's per-step sum)::

        chunk i (0-based, full):  q = b,  keys = c + (i + 1) * b
        last (partial) chunk:     q = r,  keys = c + u
    """
    if uncached_tokens <= 0:
        return 0
    b = max(1, chunk_tokens)
    n, r = divmod(uncached_tokens, b)
    c = cached_tokens
    return b * n * c + b * b * n * (n + 1) // 2 + r * (c + uncached_tokens)


def predict_ttft_s(
    cost: CostModel,
    max_batched_tokens: int,
    *,
    uncached_tokens: int,
    qk_pairs: int,
    queued_tokens: int = 0,
    queued_qk_pairs: int = 0,
    num_decoding: int = 0,
) -> float:
    """Seconds until the request's first token (see the module docstring).

    Args:
        uncached_tokens: this request's prompt tokens the worker must compute (>= 1).
        qk_pairs: ``prefill_qk_pairs`` of this request.
        queued_tokens: uncached prompt tokens of requests ahead of it (queued or prefilling).
        queued_qk_pairs: their ``prefill_qk_pairs``.
        num_decoding: requests past their first token.
    """
    return ttft_s(cost, max_batched_tokens, uncached_tokens, qk_pairs, queued_tokens,
                  queued_qk_pairs, num_decoding)


def ttft_s(cost: CostModel, max_batched_tokens: int, uncached_tokens: int, qk_pairs: int,
           queued_tokens: int, queued_qk_pairs: int, num_decoding: int) -> float:
    """``predict_ttft_s`` with positional arguments (the router's per-worker hot path)."""
    per_step = max_batched_tokens - num_decoding
    if per_step < 1:
        per_step = 1
    tokens = queued_tokens + (uncached_tokens if uncached_tokens > 1 else 1)
    steps = -(-tokens // per_step)
    # NOTE: a step whose prefill is one token is priced as a decode (the sim tells prefill from
    # decode by query length); the last step is that one when one token is left over
    single = cost.decode_s_per_token - cost.prefill_s_per_token if tokens % per_step == 1 else 0.0
    return (steps * (cost.step_overhead_s + cost.decode_s_per_token * num_decoding)
            + cost.prefill_s_per_token * tokens + single
            + cost.attn_s_per_qk * (queued_qk_pairs + qk_pairs))


def prefill_work_s(cost: CostModel, uncached_tokens: int, qk_pairs: int) -> float:
    """The worker time this request's own prefill takes, overheads aside: what routing it to a
    worker adds to the wait of everyone after it there."""
    return cost.prefill_s_per_token * uncached_tokens + cost.attn_s_per_qk * qk_pairs
