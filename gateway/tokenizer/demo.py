"""Files of the built-in demo tokenizer: byte-level, no merges, ChatML specials, deterministic.

Layout of the ids (the demo model's vocab_size may be larger; ids past the end decode to nothing):

    | ids        | tokens                                                   |
    |------------|----------------------------------------------------------|
    | 0 .. 255   | byte b (id == b), spelled in GPT-2's byte-to-unicode map |
    | 256 .. 269 | DEMO_SPECIAL_TOKENS, in order (the last four, the media   |
    |            | markers, were added after the first ten: ids never move)  |
"""

import json
from pathlib import Path
from typing import Any

DEMO_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
NUM_BYTE_TOKENS = 256
DEMO_VOCAB_SIZE_MIN = NUM_BYTE_TOKENS + len(DEMO_SPECIAL_TOKENS)
DEMO_MODEL_MAX_LENGTH = 32768
DEMO_EOS_TOKEN = "<|im_end|>"
DEMO_PAD_TOKEN = "<|pad|>"
# NOTE: like Qwen, only the control tokens are `special` (dropped by skip_special_tokens); the
# tool-call and think markers stay visible in decoded text so that parsers can find them.
_CONTROL_TOKENS = frozenset({"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>",
                             "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                             "<|video_pad|>"})
# NOTE: Qwen2-VL's markers: the chat template writes one pad token per image or video between
# vision_start and vision_end; the gateway widens each pad into the media's placeholder span
IMAGE_PAD_TOKEN = "<|image_pad|>"
VIDEO_PAD_TOKEN = "<|video_pad|>"
# Chat turns end at <|im_end|>; a raw completion may end at <|endoftext|>.
_GENERATION_EOS_TOKENS = ("<|im_end|>", "<|endoftext|>")


def write_demo_tokenizer(model_dir: str | Path) -> None:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json and
    generation_config.json into `model_dir` (created if missing). The bytes never vary."""
    out = Path(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "tokenizer.json", _tokenizer_json())
    _write_json(out / "tokenizer_config.json", _tokenizer_config())
    special_tokens_map = {"eos_token": DEMO_EOS_TOKEN, "pad_token": DEMO_PAD_TOKEN}
    _write_json(out / "special_tokens_map.json", special_tokens_map)
    _write_json(out / "generation_config.json", _generation_config())


def demo_chat_template() -> str:
    """The chat template shipped with the demo tokenizer (usable with any ChatML tokenizer)."""
    return Path(__file__).with_name("chat_template.jinja").read_text(encoding="utf-8")


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = {b: chr(b) for b in printable}
    shifted = (b for b in range(NUM_BYTE_TOKENS) if b not in chars)
    chars.update({b: chr(NUM_BYTE_TOKENS + n) for n, b in enumerate(shifted)})
    return dict(sorted(chars.items()))


def _special_id(token: str) -> int:
    return NUM_BYTE_TOKENS + DEMO_SPECIAL_TOKENS.index(token)


def _added_token(token: str) -> dict[str, Any]:
    return {
        "content": token,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": token in _CONTROL_TOKENS,
    }


def _tokenizer_json() -> dict[str, Any]:
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    model = {
        "type": "BPE",
        "dropout": None,
        "unk_token": None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        "byte_fallback": False,
        "ignore_merges": False,
        "vocab": {char: byte for byte, char in byte_to_unicode().items()},
        "merges": [],
    }
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": _special_id(t), **_added_token(t)} for t in DEMO_SPECIAL_TOKENS],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": model,
    }


def _tokenizer_config() -> dict[str, Any]:
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": {str(_special_id(t)): _added_token(t) for t in DEMO_SPECIAL_TOKENS},
        "bos_token": None,
        "chat_template": demo_chat_template(),
        "clean_up_tokenization_spaces": False,
        "eos_token": DEMO_EOS_TOKEN,
        "errors": "replace",
        "model_max_length": DEMO_MODEL_MAX_LENGTH,
        "pad_token": DEMO_PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def _generation_config() -> dict[str, Any]:
    return {
        "bos_token_id": None,
        "eos_token_id": [_special_id(t) for t in _GENERATION_EOS_TOKENS],
        "pad_token_id": _special_id(DEMO_PAD_TOKEN),
    }


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    # NOTE: our own serialization (insertion order, fixed indent, "\n" line ends and a trailing
    # newline), so the bytes do not depend on the `tokenizers` or `json` defaults of the day.
    text = json.dumps(obj, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    path.write_bytes(text.encode("utf-8"))
