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
from collections.abc import Collection, Iterator
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

NUM_MERGES = 16_000
CORPUS_BYTES = 6_000_000  # NOTE: ~10 s of training on one core


def write_bpe_tokenizer(model_dir: Path, num_merges: int = NUM_MERGES) -> int:
    """Replace ``model_dir/tokenizer.json`` (the demo's, written before) by a BPE with
    ``num_merges`` merges; returns the vocabulary size (ids past the demo's are merged tokens)."""
    path = Path(model_dir) / "tokenizer.json"
    doc = json.loads(path.read_text(encoding="utf-8"))
    # NOTE: the demo's byte ids, and its specials in the model's vocabulary too (or `tokenizers`
    # moves them past its end); each merged token after all of them
    vocab = doc["model"]["vocab"] | {t["content"]: t["id"] for t in doc["added_tokens"]}
    merged, merges = _train(num_merges, known=vocab.keys())
    first = max(vocab.values()) + 1
    vocab |= {token: first + n for n, token in enumerate(merged)}
    doc["model"]["vocab"], doc["model"]["merges"] = vocab, merges
    path.write_text(json.dumps(doc, ensure_ascii=False) + "\n", encoding="utf-8")
    return first + len(merged)


def _train(num_merges: int, known: Collection[str]) -> tuple[list[str], list[list[str]]]:
    """(the tokens the trainer merged, not in ``known``, in its order; the merges) learned from
    ``_corpus()``."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + num_merges, show_progress=False,
                                  initial_alphabet=alphabet)
    bpe.train_from_iterator(_corpus(), trainer)
    model = json.loads(bpe.to_str())["model"]
    merged = [t for _, t in sorted((i, t) for t, i in model["vocab"].items() if t not in known)]
    merges = [m.split(" ") if isinstance(m, str) else list(m) for m in model["merges"]]
    return merged, merges


def _corpus() -> Iterator[str]:
    left = CORPUS_BYTES
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if left <= 0 or "test" in path.parts:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        left -= len(text)
        yield text
