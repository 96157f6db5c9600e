"""A BPE tokenizer for the gateway benchmarks, trained here (no download).

The demo tokenizer spends one token per byte: a gateway in front of it tokenizes, hashes, routes
and ships ~4 x the tokens a production tokenizer (~4 characters a token on English) would for the
same text. This one keeps the demo's ids (bytes 0..255, then its ChatML specials, so its chat
template, stop ids and sim worker work unchanged) and adds merges learned from this Python's own
standard library source: deterministic for a given Python installation.

    write_bpe_tokenizer(model_dir)   overwrite model_dir's tokenizer.json; returns its vocab size
"""

import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from gateway.tokenizer.demo import (
    DEMO_SPECIAL_TOKENS,
    DEMO_VOCAB_SIZE_MIN,
    NUM_BYTE_TOKENS,
    byte_to_unicode,
)

NUM_MERGES = 16_000
CORPUS_BYTES = 6_000_000  # NOTE: ~10 s of training on one core


def write_bpe_tokenizer(model_dir: Path, num_merges: int = NUM_MERGES) -> int:
    """Replace ``model_dir/tokenizer.json`` (the demo's, written before) by a BPE with
    ``num_merges`` merges; returns the vocabulary size (ids past the demo's are merged tokens)."""
    path = Path(model_dir) / "tokenizer.json"
    doc = json.loads(path.read_text(encoding="utf-8"))
    vocab, merges = _train(num_merges)
    doc["model"]["vocab"] = vocab
    doc["model"]["merges"] = merges
    path.write_text(json.dumps(doc, ensure_ascii=False) + "\n", encoding="utf-8")
    return max(vocab.values()) + 1


def _train(num_merges: int) -> tuple[dict[str, int], list[list[str]]]:
    """(vocab, merges): the demo's byte ids, then each merged token after the specials."""
    alphabet = byte_to_unicode()
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + num_merges, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(_corpus(), trainer)
    model = json.loads(bpe.to_str())["model"]
    vocab = {char: byte for byte, char in alphabet.items()}
    merged = sorted((i, t) for t, i in model["vocab"].items() if t not in vocab)
    # NOTE: the specials in the model's vocabulary too, or `tokenizers` moves them past its end
    vocab |= {token: NUM_BYTE_TOKENS + n for n, token in enumerate(DEMO_SPECIAL_TOKENS)}
    vocab |= {token: DEMO_VOCAB_SIZE_MIN + n for n, (_, token) in enumerate(merged)}
    merges = [m.split(" ") if isinstance(m, str) else list(m) for m in model["merges"]]
    return vocab, merges


def _corpus() -> Iterator[str]:
    left = CORPUS_BYTES
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if left <= 0 or "test" in path.parts:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        left -= len(text)
        yield text
