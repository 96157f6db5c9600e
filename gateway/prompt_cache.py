"""PromptCache: tokens once. Agent frameworks resend the whole conversation every turn; keep the
rendered token ids of recent conversations, keyed by a chained hash of their messages, so that a
request extending a known conversation renders and tokenizes only its new messages.

How a hit at message j (messages[:j] cached, n messages sent) is rendered:

    | piece        | text                                                  | token ids        |
    |--------------|-------------------------------------------------------|------------------|
    | prefix       | render(messages[:j], gen=False)                       | cached, reused   |
    | body         | render(anchor + messages[j:], gen=False)[len(a0):]    | encode(body)     |
    | gen prompt   | render(anchor + messages[j:], gen=True)[len(a1):]     | encode(gen)      |

(the pieces come from ``sessions.prompt.PieceRenderer``, which session turns use too) where
anchor = [messages[0], messages[j-1]] (one of them when j == 1) gives the template the
context it reads (the system message, the previous message's role) and a0 = render(anchor,
gen=False). The prefix render is never redone, so the template renders O(system + new messages)
characters a turn, not O(history).

Two properties of the template make this exact, and both are checked rather than assumed:
- prefix stability (render(anchor) is a prefix of render(anchor + new), a check on every request)
  and anchor sufficiency (the pieces equal a full render): the first request of each kind (hit or
  miss, with or without tools) is compared with `Tokenizer.encode_chat` and, if it differs, that
  kind always falls back to a full render from then on;
- tokenization boundaries: the pieces are tokenized separately, which equals tokenizing their
  concatenation only where no BPE merge or pre-tokenizer split crosses a cut. Each cut must touch
  an added token that strips no whitespace (ChatML's <|im_start|>, <|im_end|>, </tool_response>):
  added tokens are split out before the model runs, so nothing merges across them. Otherwise the
  request falls back to a full encode.

Thread-safe: the gateway encodes small prompts on its event loop and large ones on a thread; a
lock guards the entries and the stats, never the rendering or tokenizing.
"""

import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec
import xxhash

from gateway.tokenizer import Tokenizer
from gateway.tokenizer.template import Message
from sessions.prompt import PieceRenderer, cut_ids_of

_JSON = msgspec.json.Encoder(order="sorted")
DEFAULT_MAX_BYTES = 128 * 1024 * 1024
# NOTE: an upper bound on what one stored token costs: an 8-byte list slot plus a 28-byte int
# object (ids above 256 are not interned; turns of one conversation share their prefix's ints,
# which this ignores, so real use is lower). Plus a list header, an OrderedDict node and a key.
TOKEN_BYTES = 36
ENTRY_BYTES = 200


class EncodedPrompt(NamedTuple):
    token_ids: list[int]
    reused_tokens: int  # leading token ids taken from the cache, not tokenized again
    rendered_chars: int  # characters the chat template rendered for this request
    # NOTE: names the conversation across its turns (its first two messages, tools and salt
    # included): the key the router's page hasher extends a chain under (None: no messages)
    conversation: int | None = None


@dataclass(slots=True)
class PromptCacheStats:
    hits: int = 0
    misses: int = 0
    fallbacks: int = 0  # requests rendered and tokenized in full because a check failed
    reused_tokens: int = 0
    tokenized_tokens: int = 0  # prompt token ids that were tokenized (not reused)
    evictions: int = 0
    cpu_s: float = 0.0  # thread CPU time spent in encode() (rendering and tokenizing)


class PromptCache:
    """Token ids of recent conversations, bounded by `max_entries` and by `max_bytes` of memory
    (least recently used first out). Tenants with different `cache_salt` never share entries;
    different `tools` (or another chat template) never share entries either.

    NOTE: the byte bound is what keeps the gateway's memory flat. Each entry is charged
    `ENTRY_BYTES + TOKEN_BYTES * len(ids)`, an upper bound on what it holds (the default 128 MiB
    is at least 3.7M tokens); an entry over the whole bound is not stored. A conversation pushed
    out is rendered and tokenized in full on its next turn: correct, only slower.
    """

    def __init__(
        self, tokenizer: Tokenizer, max_entries: int = 10_000, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        assert max_entries > 0 and max_bytes > 0, f"{max_entries=}, {max_bytes=}: must be > 0"
        self._tokenizer = tokenizer
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        template = (tokenizer.chat_template or "").encode()
        self._template_hash = xxhash.xxh3_64_intdigest(template)
        self._pieces = PieceRenderer(tokenizer, cut_ids_of(tokenizer))
        self._entries: OrderedDict[int, list[int]] = OrderedDict()
        self._num_tokens = 0
        self._num_bytes = 0
        self._verified: set[tuple[bool, bool]] = set()  # (has_tools, is_hit) checked once
        self._unstable: set[bool] = set()  # has_tools values that always render in full
        self.stats = PromptCacheStats()

    def encode(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None = None,
        cache_salt: str | None = None,
    ) -> EncodedPrompt:
        """Token ids of the conversation with the generation prompt, exactly
        `tokenizer.encode_chat(messages, tools, add_generation_prompt=True)`.

        Raises what the template raises (jinja2.TemplateError, ValueError without a template),
        and TypeError / msgspec.EncodeError for a message that is not JSON-like.
        """
        t0 = time.thread_time()
        try:
            return self._encode(messages, tools, cache_salt)
        finally:
            with self._lock:
                self.stats.cpu_s += time.thread_time() - t0

    def _encode(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None,
        cache_salt: str | None,
    ) -> EncodedPrompt:
        has_tools = bool(tools)
        if not messages:
            return self._full(messages, tools, count_fallback=False)
        hashes = message_hashes(self._seed(tools, cache_salt), messages)
        conversation = hashes[min(1, len(hashes) - 1)]
        if has_tools in self._unstable:
            return self._full(messages, tools, count_fallback=True, conversation=conversation)
        with self._lock:  # NOTE: entries are never mutated, only replaced: no copy needed
            num_cached, prefix_ids = self._longest_prefix(hashes)
        pieces = self._pieces.pieces(messages, tools, num_cached, prefix_ids)
        if pieces is None:
            return self._full(messages, tools, count_fallback=True, conversation=conversation)
        body_ids, gen_ids, rendered_chars = pieces
        token_ids = [*prefix_ids, *body_ids, *gen_ids]
        kind = (has_tools, num_cached > 0)
        if kind not in self._verified and not self._verify(kind, messages, tools, token_ids):
            return self._full(messages, tools, count_fallback=True, conversation=conversation)
        with self._lock:
            self._count(num_cached, len(prefix_ids), len(body_ids) + len(gen_ids))
            self._store(hashes, num_cached, [*prefix_ids, *body_ids])
        return EncodedPrompt(token_ids, len(prefix_ids), rendered_chars, conversation)

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    @property
    def num_tokens(self) -> int:
        """Token ids held over all entries."""
        return self._num_tokens

    @property
    def num_bytes(self) -> int:
        """Memory charged to the entries (an upper bound, see the class docstring)."""
        return self._num_bytes

    def _seed(self, tools: Sequence[Mapping[str, Any]] | None, cache_salt: str | None) -> int:
        identity = _JSON.encode([self._template_hash, tools, cache_salt])
        return xxhash.xxh3_64_intdigest(identity)

    def _longest_prefix(self, hashes: list[int]) -> tuple[int, list[int]]:
        for num_messages in range(len(hashes), 0, -1):
            prefix_ids = self._entries.get(hashes[num_messages - 1])
            if prefix_ids is not None:
                return num_messages, prefix_ids
        return 0, []

    def _verify(
        self,
        kind: tuple[bool, bool],
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None,
        token_ids: list[int],
    ) -> bool:
        same = self._tokenizer.encode_chat(messages, tools, add_generation_prompt=True) == token_ids
        with self._lock:
            if same:
                self._verified.add(kind)
            else:
                self._unstable.add(kind[0])
        return same

    def _full(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None,
        *,
        count_fallback: bool,
        conversation: int | None = None,
    ) -> EncodedPrompt:
        text = self._tokenizer.apply_chat_template(messages, tools, add_generation_prompt=True)
        token_ids = self._tokenizer.encode(text)
        with self._lock:
            self.stats.misses += 1
            self.stats.fallbacks += count_fallback
            self.stats.tokenized_tokens += len(token_ids)
        return EncodedPrompt(token_ids, 0, len(text), conversation)

    def _count(self, num_cached: int, reused_tokens: int, tokenized_tokens: int) -> None:
        self.stats.tokenized_tokens += tokenized_tokens
        if num_cached:
            self.stats.hits += 1
            self.stats.reused_tokens += reused_tokens
        else:
            self.stats.misses += 1

    def _store(self, hashes: list[int], num_cached: int, token_ids: list[int]) -> None:
        """Only safe while locked. NOTE: an entry found before rendering may have been evicted
        by another thread since, hence the membership checks."""
        key = hashes[-1]
        if num_cached == len(hashes):  # the same conversation again: just refresh it
            if key in self._entries:
                self._entries.move_to_end(key)
            return
        if num_cached and (prefix := hashes[num_cached - 1]) in self._entries:
            # NOTE: the prefix just extended is demoted to least recently used rather than
            # dropped: its extension is what the next turn will hit, but a branch off the same
            # prefix (a retry, a sub-agent) can still find it until memory runs short.
            self._entries.move_to_end(prefix, last=False)
        if entry_bytes(len(token_ids)) > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:  # NOTE: another thread stored the same conversation meanwhile
            self._num_tokens -= len(old)
            self._num_bytes -= entry_bytes(len(old))
        self._entries[key] = token_ids
        self._num_tokens += len(token_ids)
        self._num_bytes += entry_bytes(len(token_ids))
        self._evict()

    def _evict(self) -> None:
        while len(self._entries) > self.max_entries or self._num_bytes > self.max_bytes:
            _, token_ids = self._entries.popitem(last=False)
            self._num_tokens -= len(token_ids)
            self._num_bytes -= entry_bytes(len(token_ids))
            self.stats.evictions += 1


def entry_bytes(num_tokens: int) -> int:
    """What an entry of ``num_tokens`` ids is charged against ``max_bytes``."""
    return ENTRY_BYTES + TOKEN_BYTES * num_tokens


def message_hashes(seed: int, messages: Sequence[Message]) -> list[int]:
    """Chained xxh3_64: hash i covers hash i-1 (the seed for i == 0) and message i's canonical
    JSON (sorted keys), so equal hashes mean equal conversations up to and including i."""
    hashes: list[int] = []
    prev = seed
    for message in messages:
        prev = xxhash.xxh3_64_intdigest(prev.to_bytes(8, "little") + _JSON.encode(message))
        hashes.append(prev)
    return hashes
