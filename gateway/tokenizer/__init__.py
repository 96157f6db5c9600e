"""Tokenization for the gateway: HF-layout tokenizers, chat templates, streaming detokenization,
and the deterministic demo tokenizer of the built-in model. Never imports torch or transformers."""

from gateway.tokenizer.demo import DEMO_VOCAB_SIZE_MIN, write_demo_tokenizer
from gateway.tokenizer.stream import StreamDecoder
from gateway.tokenizer.tokenizer import Tokenizer

__all__ = ["DEMO_VOCAB_SIZE_MIN", "StreamDecoder", "Tokenizer", "write_demo_tokenizer"]
