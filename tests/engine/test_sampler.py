"""Sampler and SamplingParams: filter math against brute-force references, seeded determinism,
the empirical distribution of draws, and logprobs."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine.sampler import (
    SampleOutput,
    Sampler,
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_generator,
)
from engine.sampling_params import SamplingParams

# Tokens whose cumulative mass or probability ratio lies this close to a threshold may fall on
# either side of it in float32; the references accept both outcomes for them.
_BOUNDARY_TOL = 1e-5
# Chi-square 0.9999 quantile for 7 degrees of freedom (8 tokens): a correct sampler exceeds it with
# probability 1e-4, and the seeds are fixed, so the tests below cannot flake.
_CHI2_LIMIT_7_DOF = 29.9

_logit_lists = st.lists(
    st.floats(min_value=-30, max_value=30, allow_nan=False, width=32), min_size=1, max_size=40
)
_fast = settings(max_examples=60, deadline=None)


@pytest.fixture(autouse=True)
def _seeded_default_rng() -> Iterator[None]:
    """Unseeded rows draw from torch's global RNG: seed it per test and restore it afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        yield


# --- greedy ---------------------------------------------------------------------------------------


def test_greedy_rows_take_argmax_lowest_index_on_ties() -> None:
    logits = _make_logits(num_rows=4, vocab_size=50, seed=0)
    logits[3] = torch.tensor([1.0, 5.0, 5.0, 0.0] + [-1.0] * 46)
    params = [
        _make_params(temperature=0.0),
        _make_params(temperature=0.0, top_p=0.1, top_k=7, min_p=0.5, seed=3),
        _make_params(temperature=1e-6),  # below GREEDY_TEMPERATURE: dividing would overflow
        _make_params(temperature=0.0),
    ]
    out = _sample(logits, params)
    _assert_tokens_equal(out.token_ids, logits.argmax(dim=-1), "greedy rows")
    assert out.token_ids[3].item() == 1, f"tie broke to {out.token_ids[3].item()}, want 1"


@pytest.mark.parametrize("temperature", [0.3, 1.0, 10.0])
def test_top_k_one_is_argmax_at_any_temperature(temperature: float) -> None:
    logits = _make_logits(num_rows=64, vocab_size=200, seed=1)
    params = [_make_params(temperature=temperature, top_k=1, seed=i) for i in range(64)]
    out = _sample(logits, params, _make_generators(range(64)))
    _assert_tokens_equal(out.token_ids, logits.argmax(dim=-1), f"top_k=1, T={temperature}")


def test_sampling_params_is_greedy() -> None:
    assert _make_params(temperature=0.0).is_greedy
    assert _make_params(temperature=2.0, top_k=1).is_greedy
    assert not _make_params(temperature=0.1).is_greedy
    assert not _make_params(top_k=2).is_greedy


# --- filters: pure functions against references ---------------------------------------------------


@_fast
@given(logits=_logit_lists, data=st.data())
def test_apply_top_k_keeps_exactly_the_logits_at_or_above_the_kth_largest(
    logits: list[float], data: st.DataObject
) -> None:
    k = data.draw(st.integers(min_value=1, max_value=len(logits)), label="k")
    kept = _kept(apply_top_k(_row(logits), torch.tensor([k])))
    kth_largest = sorted(logits, reverse=True)[k - 1]
    expected = {i for i, v in enumerate(logits) if v >= kth_largest}
    assert kept == expected, f"k={k}, logits={logits}: kept {sorted(kept)}, want {sorted(expected)}"


def test_apply_top_k_is_per_row_and_k_equal_vocab_is_identity() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    out = apply_top_k(logits, torch.tensor([1, 4]))
    assert _kept(out[:1]) == {0}, f"row 0 with k=1 kept {_kept(out[:1])}"
    assert torch.equal(out[1], logits[1]), f"row 1 with k=V changed: {out[1]}"


@_fast
@given(
    logits=_logit_lists,
    p=st.floats(min_value=1e-6, max_value=1.0, exclude_min=False),
)
def test_apply_top_p_keeps_the_smallest_top_set_reaching_p(logits: list[float], p: float) -> None:
    logits = _row(logits)[0].tolist()  # the float32 values the function sees
    kept = _kept(apply_top_p(_row(logits), torch.tensor([p])))
    _assert_is_top_set(kept, logits, f"top_p={p}")
    allowed = _reference_top_p_sizes(logits, p)
    assert len(kept) in allowed, (
        f"top_p={p}, logits={logits}: kept {len(kept)} tokens, reference allows {sorted(allowed)}"
    )


def test_apply_top_p_keeps_the_top_token_even_for_tiny_p() -> None:
    logits = torch.tensor([[0.0, 0.1, 0.2, 0.3], [5.0, 5.0, 5.0, 5.0]])
    kept_rows = [_kept(row[None]) for row in apply_top_p(logits, torch.tensor([1e-9, 1e-9]))]
    assert kept_rows == [{3}, {0}], f"kept {kept_rows}, want the top token (lowest index on ties)"


def test_apply_top_p_stops_as_soon_as_the_mass_reaches_p() -> None:
    # Four equal tokens: the masses above each are exactly 0, 0.25, 0.5, 0.75 in float32.
    kept = _kept(apply_top_p(torch.zeros(1, 4), torch.tensor([0.5])))
    assert kept == {0, 1}, f"p=0.5 over four equal tokens kept {sorted(kept)}, want [0, 1]"


def test_apply_top_p_one_is_identity_even_with_tiny_tail_probabilities() -> None:
    logits = torch.cat([torch.tensor([[50.0]]), torch.full((1, 5000), -50.0)], dim=-1)
    out = apply_top_p(logits, torch.tensor([1.0]))
    assert torch.equal(out, logits), f"top_p=1 masked {logits.numel() - len(_kept(out))} tokens"


@_fast
@given(logits=_logit_lists, min_p=st.floats(min_value=0.0, max_value=1.0))
def test_apply_min_p_drops_tokens_below_min_p_times_top_probability(
    logits: list[float], min_p: float
) -> None:
    logits = _row(logits)[0].tolist()
    kept = _kept(apply_min_p(_row(logits), torch.tensor([min_p])))
    top = max(logits)
    for i, value in enumerate(logits):
        ratio = math.exp(value - top)  # p_i / p_max
        if abs(ratio - min_p) <= _BOUNDARY_TOL * max(min_p, 1e-30):
            continue  # on the boundary: float32 may round either way
        assert (i in kept) == (ratio >= min_p), (
            f"min_p={min_p}, token {i} (p/p_max={ratio}): kept={i in kept}, logits={logits}"
        )


# --- sampling respects the filters --------------------------------------------------------------


@_fast
@given(
    logits=_logit_lists.filter(lambda xs: len(xs) >= 2),
    temperature=st.floats(min_value=0.05, max_value=5.0),
    data=st.data(),
)
# NOTE: found by hypothesis: dividing by T underflowed -1.4e-45 to -0.0, a tie with the top two
@example(logits=[0.0, 0.0, -1.401298464324817e-45], temperature=2.0, data=None).via("regression")
def test_sampled_tokens_never_fall_outside_the_top_k(
    logits: list[float], temperature: float, data: st.DataObject
) -> None:
    k = 2 if data is None else data.draw(st.integers(min_value=2, max_value=len(logits)), label="k")
    logits = _row(logits)[0].tolist()
    num_draws = 32
    params = [_make_params(temperature=temperature, top_k=k, seed=i) for i in range(num_draws)]
    out = _sample(_row(logits).expand(num_draws, -1), params, _make_generators(range(num_draws)))
    kth_largest = sorted(logits, reverse=True)[k - 1]
    outside = [t for t in out.token_ids.tolist() if logits[t] < kth_largest]
    assert not outside, f"k={k}, T={temperature}: drew {outside} below {kth_largest} in {logits}"


def test_masked_tokens_are_never_drawn() -> None:
    logits = _make_logits(num_rows=1, vocab_size=64, seed=2)
    banned = torch.arange(64) % 3 != 0
    logits[0, banned] = float("-inf")
    num_draws = 4096
    params = [_make_params(temperature=5.0, top_p=0.99, min_p=0.01)] * num_draws
    out = _sample(logits.expand(num_draws, -1).clone(), params)
    drawn = set(out.token_ids.tolist())
    assert not drawn & set(banned.nonzero().flatten().tolist()), f"drew banned tokens: {drawn}"
    assert len(drawn) > 10, f"only {len(drawn)} distinct tokens at T=5: the draw looks degenerate"


# --- seeds ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    [
        SamplingParams(temperature=0.8, seed=1234),
        SamplingParams(temperature=1.3, top_k=40, top_p=0.9, min_p=0.02, seed=7),
    ],
    ids=["no-filters", "all-filters"],
)
def test_same_seed_gives_same_tokens_whatever_the_batch(target: SamplingParams) -> None:
    num_steps, vocab_size = 12, 500
    target_logits = _make_logits(num_steps, vocab_size, seed=3)
    alone = _run_steps(target_logits, target, position=0, batch_size=1)
    assert not torch.equal(alone, target_logits.argmax(dim=-1)), "draws are all argmax: trivial"
    for position, batch_size in [(0, 4), (3, 4), (5, 9)]:
        batched = _run_steps(target_logits, target, position, batch_size)
        _assert_tokens_equal(batched, alone, f"seed {target.seed} at row {position}/{batch_size}")


def test_different_seeds_give_different_tokens() -> None:
    num_steps, vocab_size = 200, 100
    logits = _make_logits(num_steps, vocab_size, seed=4) * 0.5
    seeds = {"same": (11, 11), "different": (11, 12)}
    agreement = {}
    for name, (seed_a, seed_b) in seeds.items():
        generators = _make_generators([seed_a, seed_b])
        params = [_make_params(seed=seed_a), _make_params(seed=seed_b)]
        tokens = [_sample(row.expand(2, -1), params, generators).token_ids for row in logits]
        pairs = torch.stack(tokens)
        agreement[name] = (pairs[:, 0] == pairs[:, 1]).float().mean().item()
    assert agreement["same"] == 1.0, f"same seed agreed on only {agreement['same']:.0%} of draws"
    # Two independent draws agree with probability sum(p_i^2), about 1.3% for these logits.
    assert agreement["different"] < 0.1, f"seeds 11 and 12 agreed on {agreement['different']:.0%}"


def test_make_generator() -> None:
    assert make_generator(None, "cpu") is None
    draws = [torch.rand(4, generator=make_generator(5, "cpu")) for _ in range(2)]
    assert torch.equal(draws[0], draws[1]), f"seed 5 gave {draws[0]} then {draws[1]}"


# --- distribution ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "seeded"),
    [
        (SamplingParams(), False),
        (SamplingParams(), True),
        (SamplingParams(temperature=0.5, top_k=5), True),
        (SamplingParams(temperature=1.5, top_p=0.8), False),
        (SamplingParams(temperature=0.7, min_p=0.2), True),
    ],
    ids=["T1-default-rng", "T1-seeded", "T0.5-top_k5", "T1.5-top_p0.8", "T0.7-min_p0.2"],
)
def test_empirical_distribution_matches_filtered_softmax(
    params: SamplingParams, seeded: bool
) -> None:
    logits = [2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]
    num_draws = 20_000
    batch = _row(logits).expand(num_draws, -1)
    generators = _make_generators(range(num_draws)) if seeded else [None] * num_draws
    out = _sample(batch, [params] * num_draws, generators)
    counts = torch.bincount(out.token_ids, minlength=len(logits)).tolist()
    _assert_matches_distribution(counts, _reference_probs(logits, params), str(params))


# --- logprobs -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_logprobs_are_raw_log_softmax_at_the_chosen_tokens(dtype: torch.dtype) -> None:
    logits = _make_logits(num_rows=5, vocab_size=64, seed=5).to(dtype)
    params = [
        _make_params(temperature=0.0, logprobs=0),
        _make_params(temperature=3.0, logprobs=0),  # temperature must not leak into logprobs
        _make_params(temperature=0.5, top_k=2, logprobs=2),
        _make_params(top_p=0.3),  # did not ask; still gets its value
        _make_params(min_p=0.5, logprobs=20),
    ]
    out = _sample(logits, params)
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32, f"{out.logprobs}"
    expected = torch.log_softmax(logits.float(), dim=-1).gather(-1, out.token_ids[:, None])
    torch.testing.assert_close(out.logprobs, expected.squeeze(-1), rtol=0, atol=1e-6)


def test_top_logprobs_are_the_sorted_top_n_of_the_raw_distribution() -> None:
    logits = _make_logits(num_rows=5, vocab_size=64, seed=6)
    nums = [None, 0, 1, 5, 20]
    params = [_make_params(temperature=2.0, logprobs=n) for n in nums]
    out = _sample(logits, params)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.top_logprobs[0] is None, f"row without logprobs got {out.top_logprobs[0]}"
    assert out.top_logprobs[1] == [], f"logprobs=0 got alternatives {out.top_logprobs[1]}"
    for row, n in enumerate(nums[2:], start=2):
        _assert_top_logprobs(out.top_logprobs[row], raw[row], n, f"row {row}")


def test_no_logprobs_requested_gives_none() -> None:
    out = _sample(_make_logits(2, 16, seed=7), [_make_params(), _make_params(temperature=0.0)])
    assert out.logprobs is None and out.top_logprobs == [None, None], f"{out}"


# --- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_new_tokens", 0),
        ("max_new_tokens", 2.0),
        ("temperature", -0.1),
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", math.nan),
        ("top_k", 0),
        ("top_k", True),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("seed", -1),
        ("seed", 2**63),
        ("stop_token_ids", [1, 2]),
        ("stop_token_ids", (1, -2)),
        ("ignore_eos", "yes"),
        ("logprobs", -1),
        ("logprobs", 21),
    ],
)
def test_invalid_sampling_params_raise_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"\b{field}=") as excinfo:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert "must be" in str(excinfo.value), f"no allowed range in: {excinfo.value}"


def test_boundary_sampling_params_are_valid() -> None:
    params = SamplingParams(
        max_new_tokens=1,
        temperature=0,
        top_p=1.0,
        top_k=1,
        min_p=1.0,
        seed=2**63 - 1,
        stop_token_ids=(0, 7),
        logprobs=20,
    )
    assert params.stop_token_ids == (0, 7), f"{params}"


def test_sample_rejects_mismatched_batch() -> None:
    logits = _make_logits(2, 8, seed=8)
    with pytest.raises(ValueError, match="batch size 2"):
        Sampler().sample(logits, [_make_params()], [None, None])
    with pytest.raises(ValueError, match="logits.shape"):
        Sampler().sample(logits[0], [_make_params()], [None])


# --- builders, references and assertions ----------------------------------------------------------


def _make_logits(num_rows: int, vocab_size: int, seed: int) -> torch.Tensor:
    return torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * 3


def _make_params(**overrides: object) -> SamplingParams:
    return SamplingParams(**overrides)  # type: ignore[arg-type]


def _make_generators(seeds: Sequence[int]) -> list[torch.Generator | None]:
    return [make_generator(seed, "cpu") for seed in seeds]


def _row(logits: Sequence[float]) -> torch.Tensor:
    return torch.tensor([logits], dtype=torch.float32)


def _sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None] | None = None,
) -> SampleOutput:
    return Sampler().sample(logits, params, generators or [None] * len(params))


def _run_steps(
    target_logits: torch.Tensor, target: SamplingParams, position: int, batch_size: int
) -> torch.Tensor:
    """Decode len(target_logits) steps with the target at `position` among varied neighbours."""
    neighbours = [
        _make_params(temperature=0.0),
        _make_params(temperature=2.0, top_k=3),
        _make_params(top_p=0.5, seed=99),
        _make_params(min_p=0.3),
    ]
    params = [neighbours[i % len(neighbours)] for i in range(batch_size)]
    params[position] = target
    generators = [make_generator(p.seed, "cpu") for p in params]
    tokens = []
    for step, row in enumerate(target_logits):
        logits = _make_logits(batch_size, row.numel(), seed=100 + step)
        logits[position] = row
        tokens.append(_sample(logits, params, generators).token_ids[position])
    return torch.stack(tokens)


def _kept(logits: torch.Tensor) -> set[int]:
    """Indices of the single row's entries that a filter left finite."""
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def _reference_softmax(logits: Sequence[float]) -> list[float]:
    top = max(logits)
    weights = [math.exp(v - top) if v != -math.inf else 0.0 for v in logits]
    return [w / sum(weights) for w in weights]


def _reference_top_p_sizes(logits: Sequence[float], p: float) -> set[int]:
    """Sizes n of a top set whose mass reaches p while the top n - 1 do not; p == 1 keeps all.

    The exact answer is one size; sizes whose prefix masses sit within _BOUNDARY_TOL of p are
    also accepted, since float32 cumulative sums can round them to either side.
    """
    if p >= 1:
        return {len(logits)}
    mass = [0.0]
    for prob in sorted(_reference_softmax(logits), reverse=True):
        mass.append(mass[-1] + prob)
    sizes = range(1, len(logits) + 1)
    return {n for n in sizes if mass[n - 1] < p + _BOUNDARY_TOL and mass[n] >= p - _BOUNDARY_TOL}


def _reference_probs(logits: Sequence[float], params: SamplingParams) -> list[float]:
    """The filtered distribution, by brute force over sorted python lists (no ties in `logits`)."""
    scaled = [v / params.temperature for v in logits]
    ranked = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    keep = set(ranked[: params.top_k or len(scaled)])
    probs = _reference_softmax([v if i in keep else -math.inf for i, v in enumerate(scaled)])
    if params.top_p < 1:
        mass = 0.0
        for i in ranked:
            if mass >= params.top_p:
                keep.discard(i)
            mass += probs[i]
        probs = _reference_softmax([v if i in keep else -math.inf for i, v in enumerate(scaled)])
    top = max(probs)
    keep = {i for i in keep if probs[i] >= params.min_p * top}
    return _reference_softmax([v if i in keep else -math.inf for i, v in enumerate(scaled)])


def _assert_tokens_equal(actual: torch.Tensor, expected: torch.Tensor, context: str) -> None:
    assert torch.equal(actual, expected), (
        f"{context}: got {actual.tolist()}, want {expected.tolist()}"
    )


def _assert_is_top_set(kept: set[int], logits: Sequence[float], context: str) -> None:
    assert kept, f"{context}: every token was masked in {logits}"
    dropped = set(range(len(logits))) - kept
    if dropped:
        lowest_kept = min(logits[i] for i in kept)
        highest_dropped = max(logits[i] for i in dropped)
        assert lowest_kept >= highest_dropped, (
            f"{context}: kept {lowest_kept} but dropped {highest_dropped} in {logits}"
        )


def _assert_matches_distribution(counts: list[int], probs: list[float], context: str) -> None:
    total = sum(counts)
    impossible = [i for i, p in enumerate(probs) if p == 0 and counts[i] > 0]
    assert not impossible, f"{context}: drew tokens {impossible} of probability 0, counts={counts}"
    chi2 = sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs) if p > 0)
    expected = [round(total * p) for p in probs]
    assert chi2 < _CHI2_LIMIT_7_DOF, f"{context}: chi2={chi2:.1f}, counts={counts}, want~{expected}"


def _assert_top_logprobs(
    actual: list[tuple[int, float]] | None, raw: torch.Tensor, n: int, context: str
) -> None:
    assert actual is not None and len(actual) == n, f"{context}: want {n} entries, got {actual}"
    values = [v for _, v in actual]
    assert values == sorted(values, reverse=True), f"{context}: not sorted descending: {values}"
    expected_ids = raw.topk(n).indices.tolist()
    assert [i for i, _ in actual] == expected_ids, f"{context}: ids {actual}, want {expected_ids}"
    for token_id, value in actual:
        assert math.isclose(value, raw[token_id].item(), abs_tol=1e-6), (
            f"{context}: token {token_id} logprob {value}, want {raw[token_id].item()}"
        )
