"""Text <-> token ids for the server: a checkpoint's own `tokenizer.json` (through `tokenizers`) when
it has one, else the GPT-2 byte-level BPE the repository ships (data/gpt2), which needs no network.

Chat prompts use the checkpoint's own template (tokenizer_config.json's `chat_template`, Jinja,
rendered in a sandbox the way transformers' apply_chat_template does) when it has one; otherwise
one of two fixed templates, chosen by the vocabulary:
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

    def __init__(self, backend, eos_token_ids: tuple[int, ...], bos_token_id: int | None, source: str,
                 jinja_template: str | None = None, special_tokens: dict | None = None):
        self.backend = backend
        self.eos_token_ids = tuple(eos_token_ids)
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        self.bos_token_id = bos_token_id
        self.source = source
        has_llama3_headers = all(backend.token_to_id(t) is not None for t in LLAMA3_HEADER_TOKENS)
        self.chat_template = "checkpoint" if jinja_template else "llama-3" if has_llama3_headers else "plain"
        self._jinja = _compile_chat_template(jinja_template) if jinja_template else None
        self._special_tokens = special_tokens or {}
        # the longest token's text in characters: a text of n characters is at least n / this many tokens
        self.max_token_chars = max(1, max(len(t) for t in backend.get_vocab(with_added_tokens=True)))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens adds what the tokenizer's post-processor adds
        (Llama 3's BOS; nothing for GPT-2)."""
        return self.encode_batch([text], add_special_tokens)[0] if text else \
            self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text; `tokenizers` lets go of the GIL while it works (its batch call
        does), so a long prompt tokenized on a worker thread does not stop the event loop."""
        if not texts:
            return []
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def token_text(self, token_id: int) -> str:
        """One token's text as an API shows it (logprobs): decoded alone, special tokens included."""
        return self.backend.decode([token_id], skip_special_tokens=False)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of `ids`; ids the vocabulary lacks (a model's padding rows) decode to nothing."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict]) -> str:
        """The prompt text of OpenAI-style messages under the checkpoint's template, or this
        tokenizer's fixed one. ValueError (one line) for messages the template refuses."""
        turns = [(_role(m), _content(m)) for m in messages]
        if not turns:
            raise ValueError("messages must not be empty")
        if self._jinja is not None:
            import jinja2
            try:
                return self._jinja.render(messages=[{**m, "content": c} for m, (_, c) in zip(messages, turns)],
                                          add_generation_prompt=True, **self._special_tokens)
            except jinja2.TemplateError as exc:
                raise ValueError(f"the model's chat template refused the messages: {exc}") from None
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
    config = _read_json(folder / "tokenizer_config.json")
    template = _default_template(config.get("chat_template"), folder)
    special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
    try:
        return Tokenizer(backend, eos, bos[0] if bos else None, folder.name, template,
                         {k: v for k, v in special.items() if v is not None})
    except _template_errors() as exc:
        raise LabError(f"{folder}/tokenizer_config.json: chat_template is not valid Jinja ({exc})") from None


def _default_template(template, folder: Path) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of named ones (the "default");
    else a chat_template.jinja file beside it, as transformers 4.43+ saves it."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    return template if isinstance(template, str) and template.strip() else None


def _token_text(token) -> str | None:
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _template_errors():
    import jinja2
    return (jinja2.TemplateError,)


def _compile_chat_template(template: str):
    """The template in transformers' environment: a sandbox, trim_blocks and lstrip_blocks, the
    loop-controls extension, `tojson` keeping non-ASCII, raise_exception() and strftime_now()."""
    from datetime import datetime

    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


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
