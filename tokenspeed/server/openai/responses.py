"""OpenAI response bodies and stream chunks, for completions and chat completions.

A prompt's completion ``i`` is choice ``prompt index * n + i``. Streams send, per choice,
only deltas that carry text or a finish; chat streams open each choice with its role.
A format serves one response: it follows each choice's text (``TextOffsets``) across the
chunks of a stream, so that streamed ``text_offset`` values are those of the whole answer.
A chat reply read by parsers (``ReplyParsing``: reasoning, tool calls) is sent as the
message fields they read, and streamed as their deltas, each choice through its own
``ReplyStream``. With vLLM's ``continuous_usage_stats``, every chunk of a stream carries
the usage so far of its choice (its prompt's tokens and the tokens it kept), as vLLM's do.
"""

import json
import time
from json.encoder import encode_basestring_ascii as _string   # json.dumps of a str, in C

import attrs

from tokenspeed.api.text_updates import CompletionDelta
from tokenspeed.server.openai.chat_replies import ReplyParsing, ReplyStream, finish_reason
from tokenspeed.tokenizer import IncrementalDetokenizer

OWNER = "tokenspeed"


@attrs.frozen
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, update) -> "Usage":
        return Usage(self.prompt_tokens + update.num_prompt_tokens,
                     self.completion_tokens + update.num_output_tokens)

    def body(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def model_list(name: str, max_model_len: int, vocab_size: int) -> dict:
    return {"object": "list", "data": [model_card(name, max_model_len, vocab_size)]}


def model_card(name: str, max_model_len: int, vocab_size: int) -> dict:
    """The served model's entry, in the list and alone (``/v1/models/{model}``)."""
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": OWNER,
            "max_model_len": max_model_len, "vocab_size": vocab_size}


def gather(updates, n: int, prompt_index: int) -> list[CompletionDelta]:
    """Each completion whole (its deltas joined), indexed as a choice of the response."""
    parts = {i: [] for i in range(n)}
    for update in updates:
        for delta in update.deltas:
            parts[delta.index].append(delta)
    return [CompletionDelta(prompt_index * n + i, "".join(d.text for d in ds),
                            tuple(t for d in ds for t in d.token_ids),
                            tuple(lp for d in ds for lp in d.logprobs),
                            ds[-1].finish_reason if ds else "abort", ds[-1].stop_reason if ds else None)
            for i, ds in parts.items()]


class TextOffsets:
    """Where each token of one completion starts in its text: the characters that the
    tokens before it released (a token that ends half a character starts where that
    character does). Fed the completion's tokens in order, across a stream's chunks."""

    def __init__(self, tokenizer, skip_special_tokens: bool):
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens) \
            if tokenizer is not None else None
        self.length = 0

    def of(self, token_ids) -> list[int]:
        offsets = []
        for token_id in token_ids:
            offsets.append(self.length)
            if self.detokenizer is not None:
                self.length += len(self.detokenizer.push(token_id))
        return offsets


class _Format:
    object_name = ""
    chunk_object = ""
    id_prefix = ""

    def __init__(self, model: str, tokenizer, n: int, skip_special_tokens: bool = True,
                 continuous_usage: bool = False):
        self.model, self.tokenizer, self.n = model, tokenizer, n
        self.skip_special_tokens, self.continuous_usage = skip_special_tokens, continuous_usage
        self._offsets: dict[int, TextOffsets] = {}     # by choice index
        self._kept: dict[int, int] = {}                # tokens streamed so far, by choice index

    def _envelope(self, object_name: str, request_id: str, created: int) -> dict:
        return {"id": f"{self.id_prefix}-{request_id}", "object": object_name, "created": created,
                "model": self.model}

    def complete(self, per_prompt, created: int, request_id: str) -> dict:
        choices, usage = [], Usage()
        for index, updates in enumerate(per_prompt):
            choices += [self.choice(c) for c in gather(updates, self.n, index)]
            usage = usage.add(updates[-1])
        return {**self._envelope(self.object_name, request_id, created), "choices": choices,
                "usage": usage.body()}

    def chunk_prefix(self, request_id: str, created: int) -> str:
        """A stream event's text up to its choice: the same for every chunk of a response,
        so it is encoded once, not once per token."""
        envelope = json.dumps(self._envelope(self.chunk_object, request_id, created))
        return f'data: {envelope[:-1]}, "choices": ['

    def events(self, prefix: str, index: int, update) -> str:
        """The server-sent events of one update of prompt ``index``: a chunk per delta that
        carries text, tokens or a finish."""
        events = []
        for d in update.deltas:
            choice = index * self.n + d.index
            end = self.chunk_end(choice, d, update)
            if d.text or d.token_ids or d.finish_reason:
                events.append(f"{prefix}{self.delta_json(choice, d)}{end}")
        return "".join(events)

    def chunk_end(self, choice: int, d, update) -> str:
        """What closes a chunk of ``choice`` that streams delta ``d``: its choices, then with
        ``continuous_usage`` the choice's usage once ``d`` is counted. Call it once for every
        delta, sent or not (a parser may hold a delta's text back; its tokens still count)."""
        if not self.continuous_usage:
            return "]}\n\n"
        self._kept[choice] = kept = self._kept.get(choice, 0) + len(d.token_ids)
        return f'], "usage": {json.dumps(Usage(update.num_prompt_tokens, kept).body())}}}\n\n'

    def opening_usage(self, prompt_tokens: int) -> dict:
        """A choice's first chunk's usage field (``first_chunks``): none made yet."""
        return {"usage": Usage(prompt_tokens, 0).body()} if self.continuous_usage else {}

    def delta_json(self, index: int, d) -> str:
        """``json.dumps(self.delta_choice(index, d))``: one per streamed token and client."""
        return json.dumps(self.delta_choice(index, d))

    def first_chunks(self, request_id: str, created: int, prompt_tokens: list[int]) -> list[dict]:
        """The chunks a stream opens with, before any token: ``prompt_tokens`` a prompt."""
        return []

    def usage_chunk(self, usage: Usage, request_id: str, created: int) -> dict:
        return {**self._envelope(self.chunk_object, request_id, created), "choices": [],
                "usage": usage.body()}

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else str(token_id)

    def text_offsets(self, index: int, token_ids) -> list[int]:
        """The offsets of choice ``index``'s next tokens in its text."""
        if index not in self._offsets:
            self._offsets[index] = TextOffsets(self.tokenizer, self.skip_special_tokens)
        return self._offsets[index].of(token_ids)


class CompletionFormat(_Format):
    """``echoed``: each prompt's text, which its choices' texts begin with (``echo``); a
    stream sends it as each choice's first chunk."""
    object_name = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, model: str, tokenizer, n: int, skip_special_tokens: bool = True,
                 echoed: tuple[str, ...] = (), continuous_usage: bool = False):
        super().__init__(model, tokenizer, n, skip_special_tokens, continuous_usage)
        self.echoed = echoed

    def choice(self, c: CompletionDelta) -> dict:
        text = self.echoed[c.index // self.n] + c.text if self.echoed else c.text
        return {"index": c.index, "text": text, "logprobs": self.logprobs(c.index, c.logprobs),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def first_chunks(self, request_id: str, created: int, prompt_tokens: list[int]) -> list[dict]:
        envelope = self._envelope(self.chunk_object, request_id, created)
        return [{**envelope, "choices": [{"index": i, "text": self.echoed[i // self.n], "logprobs": None,
                                          "finish_reason": None, "stop_reason": None}],
                 **self.opening_usage(prompt_tokens[i // self.n])}
                for i in range(len(self.echoed) * self.n)]

    def delta_choice(self, index: int, d) -> dict:
        return {"index": index, "text": d.text, "logprobs": self.logprobs(index, d.logprobs),
                "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}

    def delta_json(self, index: int, d) -> str:
        """Without log-probabilities, the chunk's choice is formatted directly: the same text
        as ``json.dumps`` of its dict, in about a third of the time (the only value that
        needs encoding is the text), for every streamed token of every client."""
        if d.logprobs:
            return super().delta_json(index, d)
        return (f'{{"index": {index}, "text": {_string(d.text)}, "logprobs": null, '
                f'"finish_reason": {_value(d.finish_reason)}, "stop_reason": {_value(d.stop_reason)}}}')

    def logprobs(self, index: int, logprobs) -> dict | None:
        if not logprobs:
            return None
        return {"tokens": [self.token_text(lp.token_id) for lp in logprobs],
                "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [{self.token_text(t): v for t, v in lp.top.items()} for lp in logprobs],
                "text_offset": self.text_offsets(index, [lp.token_id for lp in logprobs])}


class ChatFormat(_Format):
    """``echoed``: the text each reply begins with (vLLM's ``echo``: the last message's); a
    stream sends it as each choice's first content, after its role."""
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, model: str, tokenizer, n: int, skip_special_tokens: bool = True,
                 parsing: ReplyParsing | None = None, continuous_usage: bool = False, echoed: str = ""):
        super().__init__(model, tokenizer, n, skip_special_tokens, continuous_usage)
        self.parsing, self.echoed = parsing, echoed
        self._streams: dict[int, ReplyStream] = {}     # by choice index

    def choice(self, c: CompletionDelta) -> dict:
        fields = {"content": c.text} if self.parsing is None else self.parsing.message(c.text)
        if self.echoed:
            fields = {**fields, "content": self.echoed + (fields.get("content") or "")}
        return {"index": c.index, "message": {"role": "assistant", **fields},
                "logprobs": self.logprobs(c.index, c.logprobs),
                "finish_reason": finish_reason(c.finish_reason, _arguments(fields)),
                "stop_reason": c.stop_reason}

    def first_chunks(self, request_id: str, created: int, prompt_tokens: list[int]) -> list[dict]:
        envelope = self._envelope(self.chunk_object, request_id, created)
        deltas = [{"role": "assistant", "content": ""}] + ([{"content": self.echoed}] if self.echoed else [])
        return [{**envelope, "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}],
                 **self.opening_usage(prompt_tokens[i // self.n])}
                for i in range(len(prompt_tokens) * self.n) for delta in deltas]

    def events(self, prefix: str, index: int, update) -> str:
        if self.parsing is None:
            return super().events(prefix, index, update)
        events = []
        for d in update.deltas:
            choice = index * self.n + d.index
            end = self.chunk_end(choice, d, update)
            events += [f"{prefix}{json.dumps(c)}{end}" for c in self._parsed_choices(choice, d)]
        return "".join(events)

    def _parsed_choices(self, index: int, d) -> list[dict]:
        """The parsers' deltas of ``d``, a chunk's choice each (none: one for the log-probabilities
        or the finish, if ``d`` has either); the log-probabilities go with the first, the
        finish with the last."""
        stream = self._streams.setdefault(index, self.parsing.stream())
        messages = stream.feed(d.text) + (stream.finish() if d.finish_reason else [])
        deltas = [m.as_openai() for m in messages] or ([{}] if d.logprobs or d.finish_reason else [])
        last = len(deltas) - 1
        return [{"index": index, "delta": delta, "logprobs": self.logprobs(index, d.logprobs) if i == 0 else None,
                 "finish_reason": finish_reason(d.finish_reason, stream.arguments) if i == last else None,
                 "stop_reason": d.stop_reason if i == last else None}
                for i, delta in enumerate(deltas)]

    def delta_choice(self, index: int, d) -> dict:
        return {"index": index, "delta": {"content": d.text} if d.text else {},
                "logprobs": self.logprobs(index, d.logprobs), "finish_reason": d.finish_reason,
                "stop_reason": d.stop_reason}

    def delta_json(self, index: int, d) -> str:
        """As ``CompletionFormat.delta_json``."""
        if d.logprobs:
            return super().delta_json(index, d)
        delta = f'{{"content": {_string(d.text)}}}' if d.text else "{}"
        return (f'{{"index": {index}, "delta": {delta}, "logprobs": null, '
                f'"finish_reason": {_value(d.finish_reason)}, "stop_reason": {_value(d.stop_reason)}}}')

    def logprobs(self, index: int, logprobs) -> dict | None:
        if not logprobs:
            return None
        return {"content": [{**self._entry(lp.token_id, lp.logprob),
                             "top_logprobs": [self._entry(t, v) for t, v in _ranked(lp)]}
                            for lp in logprobs]}

    def _entry(self, token_id: int, logprob: float) -> dict:
        """``bytes``: the token's own bytes (a token holding part of a character shows as
        U+FFFD in ``token``, and its bytes are what a client joins the text back from)."""
        text = self.token_text(token_id)
        raw = self.tokenizer.token_bytes(token_id) if self.tokenizer else text.encode("utf-8")
        return {"token": text, "logprob": logprob, "bytes": list(raw)}


def _arguments(message_fields: dict) -> list[str]:
    """The arguments' texts of a message's tool calls."""
    return [call["function"]["arguments"] for call in message_fields.get("tool_calls", ())]


def _value(value: str | int | None) -> str:
    """``json.dumps`` of a finish or stop reason, without its per-call overhead."""
    return "null" if value is None else _string(value) if isinstance(value, str) else str(int(value))


def _ranked(lp) -> list[tuple[int, float]]:
    """A chat position's ``top_logprobs``: the ``top_logprobs`` most likely tokens, as many as
    asked (OpenAI's shape). The sampled token is the position's own entry, so the one
    ``top`` holds after them when it is not among them is left out here."""
    entries = list(lp.top.items())
    return entries if lp.ranked is None else entries[:lp.ranked]
