"""Images in the engine (issue 13): prompt rows inside media spans take the given embeddings.

Checked against transformers' ``MiMoV2FlashForCausalLM`` called with ``inputs_embeds`` (logits
and greedy tokens, through the paged engine with chunked prefill and a batch of several
requests); the prefix cache (a repeated image is a hit, another image misses from its first
page on, cached and uncached tokens agree); chunked prefill splitting an image; embeddings that
matter; and the validation of spans.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.kv.layout import KVLayout
from engine.llm import LLM, RequestOutput
from engine.model_config import ModelConfig
from engine.protocol import MEDIA_ID_BASE, MEDIA_ID_LIMIT
from engine.sampling_params import SamplingParams
from engine.sequence import Media, media_rows

transformers = pytest.importorskip("transformers")

PAGE = 4
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
TOL = {"float32": 1e-4, "bfloat16": 2e-2}


@pytest.fixture(scope="module")
def model_dir(make_checkpoint) -> Path:
    return make_checkpoint(seed=11, layers="FSSF", sliding_window=4, mlp="DMMD")


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    """Paged, prefix cache off, chunks of 8 tokens (so a prefill splits images)."""
    return LLM(model_dir, dtype="float32", device="cpu", page_size=PAGE,
               max_num_batched_tokens=8, enable_prefix_cache=False)


# ---------------------------------------------------------------------- builders


def _make_ids(image: int, length: int) -> list[int]:
    """The placeholder ids of one image (the gateway derives them from its content hash)."""
    return [MEDIA_ID_BASE + image * 4096 + j for j in range(length)]


def _make_embeds(llm: LLM, length: int, seed: int) -> torch.Tensor:
    """Random embeddings at the scale of the model's token embeddings."""
    table = llm.model.model.embed_tokens.weight
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(length, table.shape[1], generator=gen) * float(table.float().std())


def _make_prompt(seed: int, parts: list[int | tuple[int, int]]) -> list[int]:
    """Text runs (an int: that many random ids) and images ((image, length): its ids)."""
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for part in parts:
        if isinstance(part, int):
            out += torch.randint(8, 300, (part,), generator=gen).tolist()
        else:
            out += _make_ids(*part)
    return out


def _ref_inputs(ref, prompt: list[int], media: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """transformers' input embeddings of ``prompt`` with the media rows replaced: [1, n, H]."""
    ids = torch.tensor([t if t < MEDIA_ID_BASE else 0 for t in prompt])
    x = ref.get_input_embeddings()(ids).clone()
    for offset, embeds in media:
        x[offset : offset + len(embeds)] = embeds.to(x.dtype)
    return x[None]


def _ref_greedy(ref, prompt: list[int], media: list[tuple[int, torch.Tensor]],
                n: int) -> list[int]:
    """Greedy tokens of the reference, recomputing the whole prefix each step."""
    x = _ref_inputs(ref, prompt, media)
    out: list[int] = []
    for _ in range(n):
        token = int(ref(inputs_embeds=x).logits[0, -1].argmax())
        out.append(token)
        x = torch.cat([x, ref.get_input_embeddings()(torch.tensor([[token]]))], dim=1)
    return out


def _assert_same_tokens(got: RequestOutput, want: RequestOutput | list[int], what: str) -> None:
    want_ids = list(want if isinstance(want, list) else want.token_ids)
    assert list(got.token_ids) == want_ids, f"{what}: {list(got.token_ids)} != {want_ids}"


# ---------------------------------------------------------------------- parity


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@torch.inference_mode()
def test_logits_match_transformers_with_inputs_embeds(make_checkpoint, dtype: str) -> None:
    model_dir = make_checkpoint(seed=12, dtype=dtype, layers="FSSF", sliding_window=4,
                                mlp="DMMD")
    ours = LLM(model_dir, dtype=dtype, device="cpu")
    ref = transformers.MiMoV2FlashForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="eager",
        experts_implementation="eager").eval()
    prompt = _make_prompt(1, [3, (1, 6), 5, (2, 5), 4])
    media = [(3, _make_embeds(ours, 6, 1)), (14, _make_embeds(ours, 5, 2))]
    got = ours.prompt_logits(prompt, media)
    want = ref(inputs_embeds=_ref_inputs(ref, prompt, media)).logits[0].float()
    err = (got - want).abs().max().item()
    assert err <= TOL[dtype], f"{dtype}: max |ours - transformers| = {err:.3g}"


@torch.inference_mode()
def test_greedy_tokens_match_transformers_in_a_chunked_batch(llm: LLM, model_dir: Path) -> None:
    """Three requests prefilled together in chunks of 8 (images split across chunks and
    batch rows): each one's greedy tokens are the reference's."""
    ref = transformers.MiMoV2FlashForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager",
        experts_implementation="eager").eval()
    prompts = [_make_prompt(2, [5, (3, 7), 6, (4, 3), 2]), _make_prompt(3, [13]),
               _make_prompt(4, [(5, 9), 3])]
    media = [[(5, _make_embeds(llm, 7, 3)), (18, _make_embeds(llm, 3, 4))], [],
             [(0, _make_embeds(llm, 9, 5))]]
    outs = llm.generate(prompts, GREEDY, media=media)
    for i, (prompt, items, out) in enumerate(zip(prompts, media, outs)):
        _assert_same_tokens(out, _ref_greedy(ref, prompt, items, GREEDY.max_new_tokens),
                            f"request {i}")


@torch.inference_mode()
def test_the_embeddings_matter(llm: LLM) -> None:
    """Other embeddings under the same placeholder ids give other logits and tokens (else the
    tests above would prove nothing)."""
    prompt = _make_prompt(5, [4, (6, 8), 6])
    a = [(4, _make_embeds(llm, 8, 6))]
    b = [(4, _make_embeds(llm, 8, 7))]
    diff = (llm.prompt_logits(prompt, a)[-1] - llm.prompt_logits(prompt, b)[-1]).abs().max()
    assert diff > 1e-2, f"the last logits moved by only {float(diff):.3g}"
    out_a, out_b = (llm.generate([prompt], GREEDY, media=[m])[0] for m in (a, b))
    assert out_a.token_ids != out_b.token_ids, out_a.token_ids


# ---------------------------------------------------------------------- prefix cache, chunks


@torch.inference_mode()
def test_prefix_cache_hits_a_repeated_image_and_misses_another(model_dir: Path,
                                                               llm: LLM) -> None:
    """Image at [4, 16) (page aligned). The same image again (same ids, same embeddings) is
    served from the cache through its end; another image (other ids) misses from its first
    page on. Every output equals the uncached engine's."""
    cached = LLM(model_dir, dtype="float32", device="cpu", page_size=PAGE)
    head = _make_prompt(6, [4, (7, 12)])
    image = [(4, _make_embeds(llm, 12, 8))]
    first = head + _make_prompt(7, [9])
    again = head + _make_prompt(8, [7])
    other = head[:4] + _make_ids(9, 12) + first[16:]
    other_image = [(4, _make_embeds(llm, 12, 9))]

    def run(engine: LLM, prompt: list[int], media: list[tuple[int, torch.Tensor]]
            ) -> RequestOutput:
        return engine.generate([prompt], GREEDY, media=[media])[0]

    out = run(cached, first, image)
    assert out.cached_tokens == 0, out
    _assert_same_tokens(out, run(llm, first, image), "first")
    out = run(cached, again, image)
    assert out.cached_tokens >= 16, f"the repeated image was not a hit: {out.cached_tokens}"
    _assert_same_tokens(out, run(llm, again, image), "same image, cached")
    out = run(cached, other, other_image)
    assert out.cached_tokens == 4, f"another image must miss from offset 4: {out.cached_tokens}"
    _assert_same_tokens(out, run(llm, other, other_image), "other image")


@torch.inference_mode()
def test_chunks_that_split_an_image_give_the_same_tokens(model_dir: Path, llm: LLM) -> None:
    whole = LLM(model_dir, dtype="float32", device="cpu", page_size=PAGE,
                enable_prefix_cache=False)
    tiny_chunks = LLM(model_dir, dtype="float32", device="cpu", page_size=PAGE,
                      max_num_batched_tokens=PAGE, enable_prefix_cache=False)
    prompt = _make_prompt(10, [3, (10, 11), 5, (11, 6), 1])
    media = [[(3, _make_embeds(llm, 11, 10)), (19, _make_embeds(llm, 6, 11))]]
    want = whole.generate([prompt], GREEDY, media=media)[0]
    for name, engine in (("chunks of 8", llm), ("chunks of 4", tiny_chunks)):
        _assert_same_tokens(engine.generate([prompt], GREEDY, media=media)[0], want, name)


@torch.inference_mode()
def test_preempted_requests_recompute_their_images(model_dir: Path, llm: LLM) -> None:
    """Four requests with images in a KV budget too small for all: preempted ones recompute
    their prompts (no prefix cache) with the same embeddings, so every token equals a roomy
    engine's. One request also has a repetition penalty (over its text tokens only)."""
    dtype_bytes = 4
    chunk = KVLayout.from_model(ModelConfig.from_dir(model_dir), PAGE, dtype_bytes).chunk_bytes
    tight = LLM(model_dir, dtype="float32", device="cpu", page_size=PAGE,
                enable_prefix_cache=False, kv_budget_bytes=14 * chunk,
                max_num_batched_tokens=16)
    prompts = [_make_prompt(20 + i, [3, (20 + i, 10), 4]) for i in range(4)]
    media = [[(3, _make_embeds(llm, 10, 20 + i))] for i in range(4)]
    params = [SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)] * 3 + [
        SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True,
                       repetition_penalty=1.3)]
    want = llm.generate(prompts, params, media=media)
    got = tight.generate(prompts, params, media=media)
    assert tight.engine.scheduler.num_preemptions > 0, "no request was preempted"
    for i, (g, w) in enumerate(zip(got, want)):
        _assert_same_tokens(g, w, f"request {i}")


@pytest.mark.gpu
@torch.inference_mode()
def test_cuda_matches_cpu_with_media(model_dir: Path, llm: LLM) -> None:
    """The same prompt and embeddings (given on the CPU) on CUDA: logits within 1e-3 of the
    CPU's, and the paged engine's greedy tokens (chunked, an image split) equal."""
    gpu = LLM(model_dir, dtype="float32", device="cuda", page_size=PAGE,
              max_num_batched_tokens=8, enable_prefix_cache=False)
    prompt = _make_prompt(16, [3, (16, 9), 4])
    media = [(3, _make_embeds(llm, 9, 16))]
    err = (gpu.prompt_logits(prompt, media).cpu() - llm.prompt_logits(prompt, media)).abs().max()
    assert float(err) < 1e-3, f"max |cuda - cpu| = {float(err):.3g}"
    _assert_same_tokens(gpu.generate([prompt], GREEDY, media=[media])[0],
                        llm.generate([prompt], GREEDY, media=[media])[0], "cuda")


def test_media_rows_of_a_chunk() -> None:
    media = (Media(2, 3), Media(8, 4))
    assert media_rows(media, 0, 4) == [(media[0], 2, 4)]
    assert media_rows(media, 4, 9) == [(media[0], 4, 5), (media[1], 8, 9)]
    assert media_rows(media, 5, 8) == []
    assert media_rows(media, 12, 13) == []


def test_a_model_dir_with_a_vision_tower_loads(model_dir: Path, tmp_path: Path,
                                               llm: LLM) -> None:
    """The tower's tensors (``vision_tower.*``, in a file of their own or among the LLM's) are
    the encoder's: the engine skips them."""
    with_tower = tmp_path / "with-tower"
    shutil.copytree(model_dir, with_tower)
    save_file({"vision_tower.vision_model.post_layernorm.weight": torch.ones(8),
               "vision_tower.projector.fc1.weight": torch.ones(4, 8)},
              str(with_tower / "vision_tower.safetensors"))
    loaded = LLM(with_tower, dtype="float32", device="cpu", page_size=PAGE,
                 max_num_batched_tokens=8, enable_prefix_cache=False)
    prompt = _make_prompt(15, [2, (15, 5), 3])
    media = [[(2, _make_embeds(llm, 5, 15))]]
    _assert_same_tokens(loaded.generate([prompt], GREEDY, media=media)[0],
                        llm.generate([prompt], GREEDY, media=media)[0], "with a tower")


# ---------------------------------------------------------------------- validation


def _spans_error(llm: LLM, prompt: list[int], spans: list[tuple[int, int]]) -> str:
    with pytest.raises(ValueError) as e:
        llm.engine.check_request(prompt, GREEDY, spans)
    return str(e.value)


@pytest.mark.parametrize(("spans", "message"), [
    ([(4, 0)], "media[0]: length 0: must be >= 1"),
    ([(-1, 3)], "media[0]: offset -1 is negative"),
    ([(4, 4), (6, 4)], "media[1]: offset 6 overlaps or precedes media[0], which ends at 8"),
    ([(10, 4), (4, 4)], "media[1]: offset 4 overlaps or precedes media[0], which ends at 14"),
    ([(10, 16)], "media[0]: offset 10 + length 16 exceeds the prompt's 20 tokens"),
    ([(3, 4)], "media[0]: (position, id) [(3, "),  # a text id inside the span
    ([(4, 3)], "outside the vocabulary [0, 320) (media placeholder ids need a media span)"),
])
def test_bad_media_spans_are_named(llm: LLM, spans: list[tuple[int, int]],
                                   message: str) -> None:
    prompt = _make_prompt(12, [4, (12, 4), 12])
    assert message in _spans_error(llm, prompt, spans)


def test_ids_outside_spans_must_be_text(llm: LLM) -> None:
    prompt = _make_prompt(13, [4, (13, 4), 12])
    llm.engine.check_request(prompt, GREEDY, [(4, 4)])  # NOTE: valid as given
    for bad in (320, MEDIA_ID_LIMIT, -1):
        edited = [*prompt[:10], bad, *prompt[11:]]
        assert f"prompt token ids [{bad}]" in _spans_error(llm, edited, [(4, 4)])
    beyond = [*prompt[:5], MEDIA_ID_LIMIT, *prompt[6:]]
    assert "are not media placeholder ids" in _spans_error(llm, beyond, [(4, 4)])
    with pytest.raises(ValueError, match="media placeholder ids need a media span"):
        llm.generate([prompt], GREEDY)


def test_embeddings_of_the_wrong_shape_are_named(llm: LLM) -> None:
    prompt = _make_prompt(14, [4, (14, 4), 2])
    with pytest.raises(ValueError, match=r"media\[0\]: embeddings of shape \[4, 8\]; want "
                                         r"\[length, hidden_size\] = \[4, 64\]"):
        llm.generate([prompt], GREEDY, media=[[(4, torch.zeros(4, 8))]])
    with pytest.raises(ValueError, match="exceeds the prompt's 10 tokens"):
        llm.generate([prompt], GREEDY, media=[[(4, torch.zeros(7, 64))]])
    with pytest.raises(ValueError, match="got 2 media lists for 1 prompts"):
        llm.generate([prompt], GREEDY, media=[[], []])
