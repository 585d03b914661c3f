"""Text <-> token ids for the server: a checkpoint's own `tokenizer.json` (through `tokenizers`) when
it has one, else the GPT-2 byte-level BPE the repository ships (data/gpt2), which needs no network.

Chat prompts use one of two fixed templates, never the checkpoint's Jinja (documented here, chosen
by the vocabulary):
- "llama-3" when the vocabulary has Llama 3's header tokens:
  `<|begin_of_text|>` then, per message, `<|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>`,
  then `<|start_header_id|>assistant<|end_header_id|>\\n\\n` (Meta's format, without the date
  preamble its Jinja adds to system prompts);
- "plain" otherwise (GPT-2's vocabulary): one `{role}: {content}\\n` line per message, then `assistant:`.

Streaming needs text per token, but a token can end in the middle of a UTF-8 character (or a
sentencepiece-style decoder can drop a leading space when a token is decoded alone), so
`IncrementalDetokenizer` decodes a short window of earlier tokens with the new ones and emits only
the text that grew, holding back a trailing U+FFFD until the character completes.
"""
import json
from pathlib import Path

from common.errors import LabError
from common.paths import REPO_ROOT

GPT2_FOLDER = REPO_ROOT / "data" / "gpt2"
GPT2_END_OF_TEXT = "<|endoftext|>"
LLAMA3_HEADER_TOKENS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
REPLACEMENT_CHAR = "\ufffd"
DETOKENIZER_CONTEXT_TOKENS = 5        # earlier tokens decoded beside new ones (vLLM uses the same window)


class Tokenizer:
    """encode/decode over a `tokenizers.Tokenizer`, the end-of-sequence ids, and the chat template."""

    def __init__(self, backend, eos_token_ids: tuple[int, ...], bos_token_id: int | None, source: str):
        self.backend = backend
        self.eos_token_ids = tuple(eos_token_ids)
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        self.bos_token_id = bos_token_id
        self.source = source
        has_llama3_headers = all(backend.token_to_id(t) is not None for t in LLAMA3_HEADER_TOKENS)
        self.chat_template = "llama-3" if has_llama3_headers else "plain"

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens adds what the tokenizer's post-processor adds
        (Llama 3's BOS; nothing for GPT-2)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of `ids`; ids the vocabulary lacks (a model's padding rows) decode to nothing."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict]) -> str:
        """The prompt text of OpenAI-style messages under this tokenizer's fixed template."""
        turns = [(_role(m), _content(m)) for m in messages]
        if not turns:
            raise ValueError("messages must not be empty")
        if self.chat_template == "llama-3":
            bos = "<|begin_of_text|>" if self.backend.token_to_id("<|begin_of_text|>") is not None else ""
            body = "".join(f"<|start_header_id|>{role}<|end_header_id|>\n\n{content.strip()}<|eot_id|>"
                           for role, content in turns)
            return f"{bos}{body}<|start_header_id|>assistant<|end_header_id|>\n\n"
        return "".join(f"{role}: {content}\n" for role, content in turns) + "assistant:"

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of the rendered chat prompt (the template already holds any BOS)."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)

    def detokenizer(self, prompt_ids=()) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, prompt_ids)


class IncrementalDetokenizer:
    """Text of generated tokens as they arrive: `add(ids)` returns the new complete text (maybe
    ""), `flush()` the rest at the end. Concatenating every return equals decoding the output
    at once. The last few prompt tokens seed the window so the first token's leading space
    survives decoders that strip it at the start of a string."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids=()):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids)[-DETOKENIZER_CONTEXT_TOKENS:]
        self.prefix_offset = 0                 # start of the decoded window
        self.read_offset = len(self.ids)       # text up to here has been emitted

    def add(self, new_ids) -> str:
        self.ids.extend(new_ids)
        already = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        window = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(window) <= len(already) or window.endswith(REPLACEMENT_CHAR):
            return ""                          # an incomplete character (or nothing printable) so far
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return window[len(already):]

    def flush(self) -> str:
        """Whatever is held back, replacement characters included (the sequence has ended)."""
        already = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        window = self.tokenizer.decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return window[len(already):] if len(window) > len(already) else ""


def load_tokenizer(checkpoint_folder: str | Path | None = None) -> Tokenizer:
    """The checkpoint's tokenizer.json when it has one, else the repository's GPT-2 BPE."""
    if checkpoint_folder is not None and (Path(checkpoint_folder) / "tokenizer.json").is_file():
        return _checkpoint_tokenizer(Path(checkpoint_folder))
    return gpt2_tokenizer()


def gpt2_tokenizer() -> Tokenizer:
    """GPT-2's byte-level BPE from data/gpt2/encoder.json and vocab.bpe (the ids tiktoken's `gpt2`
    gives), with <|endoftext|> (50256) as its special end-of-text token."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    encoder, merges = GPT2_FOLDER / "encoder.json", GPT2_FOLDER / "vocab.bpe"
    if not (encoder.is_file() and merges.is_file()):
        raise LabError(f"GPT-2 tokenizer files missing under {GPT2_FOLDER} (data/gpt2/encoder.json, vocab.bpe)")
    backend = Backend(models.BPE.from_file(str(encoder), str(merges)))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([GPT2_END_OF_TEXT])
    return Tokenizer(backend, (backend.token_to_id(GPT2_END_OF_TEXT),), None, "gpt2")


def _checkpoint_tokenizer(folder: Path) -> Tokenizer:
    from tokenizers import Tokenizer as Backend

    try:
        backend = Backend.from_file(str(folder / "tokenizer.json"))
    except Exception as exc:                  # tokenizers raises its own Exception type
        raise LabError(f"{folder}/tokenizer.json: cannot be read ({exc})") from None
    eos = _token_ids(folder, "eos_token_id", "eos_token", backend)
    if backend.token_to_id("<|eot_id|>") is not None:      # Llama 3 ends chat turns with it
        eos = eos + tuple(i for i in (backend.token_to_id("<|eot_id|>"),) if i not in eos)
    bos = _token_ids(folder, "bos_token_id", "bos_token", backend)
    return Tokenizer(backend, eos, bos[0] if bos else None, folder.name)


def _token_ids(folder: Path, id_field: str, token_field: str, backend) -> tuple[int, ...]:
    """A special token's id(s): generation_config.json, then config.json (ids, possibly a list),
    then tokenizer_config.json (the token's text)."""
    for name in ("generation_config.json", "config.json"):
        value = _read_json(folder / name).get(id_field)
        if value is not None:
            return tuple(value) if isinstance(value, list) else (int(value),)
    token = _read_json(folder / "tokenizer_config.json").get(token_field)
    if isinstance(token, dict):
        token = token.get("content")
    token_id = backend.token_to_id(token) if isinstance(token, str) else None
    return (token_id,) if token_id is not None else ()


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _role(message) -> str:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError("each message must be an object with a string 'role'")
    return message["role"]


def _content(message: dict) -> str:
    """A message's text: a string, or a list of {"type": "text", "text": ...} parts."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ValueError("message content must be a string or a list of text parts")
