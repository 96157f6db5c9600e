"""Read a Hugging Face model directory's tokenizer files into a `TokenizerFiles` value.

Files read (others are ignored):

    | file                   | required | what we take                                     |
    |------------------------|----------|--------------------------------------------------|
    | tokenizer.json         | yes      | the `tokenizers` pipeline and its added tokens   |
    | tokenizer_config.json  | yes      | chat_template, bos/eos/pad/unk tokens, max length |
    | chat_template.jinja    | no       | the chat template; wins over tokenizer_config    |
    | generation_config.json | no       | more end-of-turn ids (`eos_token_id`)            |
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
# Special-token keys of tokenizer_config.json that chat templates see as variables.
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclass(frozen=True, slots=True)
class TokenizerFiles:
    backend: tokenizers.Tokenizer
    chat_template: str | None
    special_tokens: dict[str, str]  # SPECIAL_TOKEN_KEYS that are set -> token text
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    model_max_length: int | None


def load_tokenizer_files(model_dir: str | Path) -> TokenizerFiles:
    """Raises FileNotFoundError naming a missing directory or required file, and ValueError
    naming the file and key of a malformed or inconsistent entry."""
    root = Path(model_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"model directory not found: {root}")
    backend = _load_backend(_require(root / TOKENIZER_FILE))
    config_path = _require(root / TOKENIZER_CONFIG_FILE)
    config = _read_json_object(config_path)
    special_tokens = {
        key: token
        for key in SPECIAL_TOKEN_KEYS
        if (token := _token_text(config, key, config_path)) is not None
    }
    ids = {key: _token_id(backend, text, key, config_path) for key, text in special_tokens.items()}
    eos_ids = [ids["eos_token"]] if "eos_token" in ids else []
    eos_ids += _generation_eos_ids(root / GENERATION_CONFIG_FILE, backend)
    return TokenizerFiles(
        backend=backend,
        chat_template=_chat_template(root, config, config_path),
        special_tokens=special_tokens,
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        pad_token_id=ids.get("pad_token"),
        model_max_length=_max_length(config, config_path),
    )


def _require(path: Path) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    return path


def _load_backend(path: Path) -> tokenizers.Tokenizer:
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # NOTE: the Rust side raises a bare Exception on malformed JSON
        raise ValueError(f"{path}: not a valid tokenizers file: {exc}") from exc


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _token_text(config: dict[str, Any], key: str, path: Path) -> str | None:
    # A token is stored as text, or (older transformers) as a serialized AddedToken.
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    if value is None or isinstance(value, str):
        return value
    raise ValueError(f"{path}: {key!r} must be a string or an AddedToken object, got {value!r}")


def _token_id(backend: tokenizers.Tokenizer, token: str, key: str, path: Path) -> int:
    token_id = backend.token_to_id(token)
    if token_id is None:
        raise ValueError(f"{path}: {key!r} = {token!r} is not in the vocabulary")
    return token_id


def _chat_template(root: Path, config: dict[str, Any], path: Path) -> str | None:
    if (root / CHAT_TEMPLATE_FILE).is_file():
        return (root / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    # Several named templates: [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ValueError(f"{path}: 'chat_template' must be a string or a list with a 'default' entry")


def _max_length(config: dict[str, Any], path: Path) -> int | None:
    value = config.get("model_max_length")
    # NOTE: transformers writes a huge sentinel (~1e30) when the length is unknown.
    if value is None or (isinstance(value, int | float) and value >= 1e18):
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise ValueError(f"{path}: 'model_max_length' must be a positive integer, got {value!r}")


def _generation_eos_ids(path: Path, backend: tokenizers.Tokenizer) -> list[int]:
    if not path.is_file():
        return []
    value = _read_json_object(path).get("eos_token_id")
    ids = value if isinstance(value, list) else [] if value is None else [value]
    if not all(_is_token_id(backend, i) for i in ids):
        raise ValueError(f"{path}: 'eos_token_id' must be ids in the vocabulary, got {value!r}")
    return ids


def _is_token_id(backend: tokenizers.Tokenizer, value: object) -> bool:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        return False
    return backend.id_to_token(value) is not None
