"""One choice of a completion as it is generated: the engine's outputs turned into text (stop
strings and stop tokens applied), token ids and logprobs entries, and each choice's body in
OpenAI's completions or chat form (echo, logprobs)."""
import time
from typing import TYPE_CHECKING

from .async_engine import EngineStopped, QueueFull
from .openai_request import ApiError, GenerationRequest, bad_request
from .stop_strings import StopStrings

if TYPE_CHECKING:
    from .server import Serving


class Choice:
    """One choice of a request: its engine outputs turned into text (stop strings and stop tokens
    applied), token ids and logprobs entries, piece by piece."""

    def __init__(self, serving: "Serving", parsed: GenerationRequest, index: int, prompt_index: int, params,
                 arrived: float):
        self.serving, self.parsed, self.index, self.params = serving, parsed, index, params
        self.prompt_index = prompt_index
        self.prompt_ids = parsed.prompts[prompt_index]
        self.prompt_text = parsed.prompt_texts[prompt_index]
        self.detokenizer = serving.tokenizer.detokenizer(self.prompt_ids)
        self.stops = StopStrings(parsed.stop, parsed.include_stop_str)
        self.ends_at_stop_token = set(params.stop_token_ids) | (set() if params.ignore_eos else
                                                                 set(serving.tokenizer.eos_token_ids))
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list = []                 # (token id, entry) per returned token
        self.finish_reason: str | None = None
        self.num_prompt_tokens = len(self.prompt_ids)
        self.num_output_tokens = 0
        self.prompt_logprobs = None
        self.outputs = None
        self.started = arrived                  # the request's arrival (perf_counter): TTFT counts its parsing
        self.first_token_s: float | None = None

    async def start(self, request_id: str, sample_group: str | None = None):
        """The engine's first output (ApiError if the request cannot run). sample_group: the key
        this prompt's n choices share (their prompt's KV blocks are shared in the engine)."""
        self.outputs = self.serving.async_engine.generate(self.prompt_ids, self.params, request_id, sample_group)
        try:
            return await anext(self.outputs)
        except QueueFull as exc:
            raise ApiError(503, f"server busy: {exc}; retry later", code="queue_full") from None
        except EngineStopped as exc:
            raise ApiError(503, str(exc), code="engine_stopped") from None
        except ValueError as exc:
            raise bad_request(str(exc)) from None

    async def pieces(self, first):
        """(text, token ids, logprobs entries) of each engine output, from `first` on; the choice's
        finish_reason is set on the last. Ends early (aborting the engine's request) at a stop string."""
        out = first
        try:
            while True:
                piece = self._piece(out)
                yield piece
                if self.finish_reason is not None:
                    return
                out = await anext(self.outputs)
        except EngineStopped as exc:
            raise ApiError(503, str(exc), code="engine_stopped") from None
        finally:
            await self.outputs.aclose()
            self._record()

    def _piece(self, out) -> tuple[str, list[int], list]:
        if self.first_token_s is None:
            self.first_token_s = time.perf_counter() - self.started
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        ids = list(out.new_token_ids)
        entries = list(out.logprobs or [])
        if self.parsed.max_tokens == 0:                  # echo only: the engine's one token is not returned
            ids, entries = [], []
            self.finish_reason = "length"
        self.num_output_tokens = len(self.token_ids) + len(ids)
        shown = ids
        if out.finish_reason == "stop" and ids and ids[-1] in self.ends_at_stop_token:
            shown = ids[:-1]                             # a stop token's own text is not output
        text, stopped = self.stops.add(self.detokenizer.add(shown))
        if out.finished and not stopped:
            more, stopped = self.stops.add(self.detokenizer.flush())
            text += more + ("" if stopped else self.stops.flush())
        self.token_ids += ids
        self.logprobs += list(zip(ids, entries))
        self.text += text
        if stopped:
            self.finish_reason = "stop"
        elif out.finished:
            self.finish_reason = self.finish_reason or out.finish_reason
        return text, ids, list(zip(ids, entries))

    def _record(self) -> None:
        reason = self.finish_reason or "abort"
        decode_s = time.perf_counter() - self.started - (self.first_token_s or 0.0)
        self.serving.metrics.finished(reason, self.num_prompt_tokens, self.num_output_tokens, self.first_token_s,
                                      decode_s if self.first_token_s is not None else None)

    # ------------------------------------------------------------------ echo and logprobs
    def echo_text(self) -> str:
        if self.prompt_text is not None:
            return self.prompt_text
        return self.serving.tokenizer.decode(self.prompt_ids)

    def completion_logprobs(self, entries, with_prompt: bool, offset: int) -> dict:
        """The legacy completions form: tokens, token_logprobs, top_logprobs (token text ->
        logprob, the chosen token among them as vLLM does), text_offset."""
        tokenizer = self.serving.tokenizer
        rows = []
        if with_prompt:
            rows.append((self.prompt_ids[0], None))
            rows += list(zip(self.prompt_ids[1:], self.prompt_logprobs or [None] * (len(self.prompt_ids) - 1)))
        rows += entries
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, entry in rows:
            text = tokenizer.token_text(token)
            out["tokens"].append(text)
            out["text_offset"].append(offset)
            offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            logprob, top = entry
            out["token_logprobs"].append(logprob)
            tops = {tokenizer.token_text(t): v for t, v in top}
            tops.setdefault(text, logprob)
            out["top_logprobs"].append(tops)
        return out

    def chat_logprobs(self, entries) -> dict:
        """Chat's form: content, one {token, logprob, bytes, top_logprobs} per token."""
        tokenizer = self.serving.tokenizer

        def item(token, logprob):
            text = tokenizer.token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}
        return {"content": [{**item(token, logprob), "top_logprobs": [item(t, v) for t, v in top]}
                            for token, (logprob, top) in entries]}


def choice_body(choice: Choice, chat: bool, text: str, entries, finish_reason, stream: bool,
                 first_event: bool = False, token_ids=None, echo: bool = False) -> dict:
    parsed = choice.parsed
    body = {"index": choice.index}
    logprobs = None
    if chat:
        body["delta" if stream else "message"] = (
            {"role": "assistant", "content": text} if first_event or not stream else {"content": text})
        if parsed.logprobs is not None:
            logprobs = choice.chat_logprobs(entries)
    else:
        shown = (choice.echo_text() + text) if echo else text
        body["text"] = shown
        if parsed.logprobs is not None:
            logprobs = choice.completion_logprobs(entries, echo, 0)
    body["logprobs"] = logprobs
    body["finish_reason"] = finish_reason
    if parsed.return_token_ids:
        body["token_ids"] = list(token_ids or [])
        if echo:
            body["prompt_token_ids"] = list(choice.prompt_ids)
    return body
