"""The engine-client interface: what a caller of the engine adds, aborts, and reads back.

``ts.LLM`` drives it in-process and the server's engine process drives it for its
clients (as vLLM's ``EngineCore`` and SGLang's scheduler serve their tokenizer managers).
A caller adds a prompt under a key of its own, steps, and gets back, per prompt that
changed, a ``TokenUpdate``: the token ids (and log-probabilities) each completion gained,
and the engine's finish, with the figures of a finished prompt. Text is not the engine's
business: detokenizing, stop strings and the final ``finish_reason`` are decided by the
caller's ``PromptOutput``, which tells the engine to ``finish`` a completion a stop string
ended. Token stops (end of sequence, ``stop_token_ids``, ``min_tokens``) and lengths stay
in the engine.

The engine is not thread-safe, nor is this: its owner serialises calls.
"""

from collections.abc import Hashable, Iterable

import attrs
import torch

from tokenspeed.api.messages import EngineLoad, TokenDelta, TokenUpdate
from tokenspeed.api.request_figures import completed
from tokenspeed.engine.core import Engine
from tokenspeed.scheduling.request import Request
from tokenspeed.execution.sampling_params import SamplingParams


@attrs.define(eq=False)
class _Prompt:
    """A prompt's requests in the engine, and how many tokens of each have gone out;
    ``at_end``: its tokens go out only when one of its completions finishes."""
    requests: list[Request]
    num_prompt_tokens: int
    sent: list[int]
    finish_sent: list[bool]
    at_end: bool = False


class EngineCore:
    def __init__(self, engine: Engine, stream_interval: int = 1):
        """``stream_interval``: a completion's tokens go out with its first, then once it has
        gained this many, and when it finishes (as SGLang's ``--stream-interval``): fewer,
        larger updates cost the engine's thread less per step than one per token."""
        self.engine, self.stream_interval = engine, stream_interval
        self._live: dict[Hashable, _Prompt] = {}
        self._news: dict[Hashable, str | None] = {}   # prompts changed between steps: their error
        self._num_finished: int | None = None         # the engine's count at the last updates

    def add(self, key: Hashable, prompt: tuple[int, ...], params: SamplingParams,
            at_end: bool = False) -> list[Request]:
        """Queue a checked prompt's ``params.n`` completions under ``key`` (the caller's,
        unique among its live prompts); returns them. ``at_end``: the caller reads nothing
        before a completion ends (an answer returned whole, with no stop string to look for
        in its text), so its tokens go out then, not every step. A value the engine cannot
        sample (one that slipped past the request check) is refused here, and nothing is
        queued."""
        if at_end and params.stop:
            raise ValueError(f"stop={list(params.stop)!r}: a prompt with stop strings has its text read as it grows")
        requests = self.engine.add(prompt, params)
        self._live[key] = _Prompt(requests, len(prompt), [0] * len(requests), [False] * len(requests), at_end)
        return requests

    def abort(self, key: Hashable) -> None:
        """End the prompt's unfinished completions now (their pages return); the next
        ``step`` reports its end. An unknown key (a prompt already reported finished) is
        nothing to do."""
        if key in self._live:
            for request in self._live[key].requests:
                self.engine.finish(request, "abort")
            self._news.setdefault(key, None)

    def finish(self, key: Hashable, index: int) -> None:
        """End completion ``index`` of the prompt now: its caller found a stop string in
        its text and holds the completion's final answer (tokens made since are dropped)."""
        if key in self._live:
            self.engine.finish(self._live[key].requests[index], "abort")
            self._news.setdefault(key, None)

    @property
    def has_work(self) -> bool:
        """The engine has work, or a prompt changed that ``step`` has not reported."""
        return bool(self._news) or self.engine.has_work

    @property
    def keys(self) -> Iterable[Hashable]:
        """The live prompts' keys (a prompt leaves once its end is reported)."""
        return self._live.keys()

    def load(self) -> EngineLoad:
        scheduler = self.engine.scheduler
        in_use = scheduler.allocator.num_pages - 1 - scheduler.allocator.num_free
        return EngineLoad(len(scheduler.running), len(scheduler.waiting), in_use)

    def step(self) -> list[tuple[Hashable, TokenUpdate]]:
        """One engine step (when it has work), then the updates of the prompts that gained
        tokens due out or finished. A step that fails ends every request in the engine and
        raises; the next ``step`` reports those prompts' ends, with the error."""
        if self.engine.has_work:
            try:
                with torch.inference_mode():
                    self.engine.step()
            except BaseException as exc:
                self._fail_all(f"{type(exc).__name__}: {exc}")
                raise
        return self._updates()

    def _fail_all(self, error: str) -> None:
        self.engine.abort_all()
        self._news.update(dict.fromkeys(self._live, error))

    def _updates(self) -> list[tuple[Hashable, TokenUpdate]]:
        """The updates of the prompts due: one pass over the live prompts, doing no more
        than a length check for a prompt with nothing due (a prompt read at its end: a
        look-up, and a scan of its completions only in a step in which some request ended)."""
        news, self._news = self._news, {}
        ended, self._num_finished = self.engine.num_finished != self._num_finished, self.engine.num_finished
        updates, interval = [], self.stream_interval
        for key, prompt in list(self._live.items()):
            if prompt.at_end:
                due = key in news or (ended and any(r.finished for r in prompt.requests))
            else:   # interval 1: any gain is due
                due = interval == 1 or key in news or _due(prompt, interval)
            if due:
                update = self._update(key, prompt, news.get(key))
                if update is not None:
                    updates.append((key, update))
        return updates

    def _update(self, key: Hashable, prompt: _Prompt, error: str | None) -> TokenUpdate | None:
        """What the prompt's completions gained (only those that gained tokens or finished,
        each finish sent once); None when nothing did. A finished prompt is forgotten. A
        completion the engine ended with an error (its constraint's) ends the prompt with it."""
        own = _own_error(prompt)
        refused, error = error is None and own is not None, error or own
        if error is not None:
            for request in prompt.requests:
                self.engine.finish(request, "abort")
        deltas, finished = [], True
        for index, request in enumerate(prompt.requests):
            delta = _delta(prompt, index, request)
            if delta is not None:
                deltas.append(delta)
            finished = finished and request.finished
        if not (finished or deltas):
            return None
        done = ()
        if finished:
            del self._live[key]
            done = tuple(map(completed, prompt.requests))
        return TokenUpdate(tuple(deltas), finished, prompt.num_prompt_tokens, error, done, refused=refused)


def _own_error(prompt: _Prompt) -> str | None:
    """The error of a completion the engine ended alone (a plain loop: every live prompt's
    update of every step asks)."""
    for request in prompt.requests:
        if request.error is not None:
            return request.error
    return None


def _due(prompt: _Prompt, interval: int) -> bool:
    """Whether a completion finished, has its first token to send, or gained ``interval``
    tokens since its last update."""
    for request, sent in zip(prompt.requests, prompt.sent):
        made = len(request.output)
        if made - sent >= interval or request.finished or (made and not sent):
            return True
    return False


def _delta(prompt: _Prompt, index: int, request: Request) -> TokenDelta | None:
    """The completion's tokens since the last update; None when it gained none and did
    not finish since."""
    start, end = prompt.sent[index], len(request.output)
    finishes = request.finished and not prompt.finish_sent[index]
    if end == start and not finishes:
        return None
    prompt.sent[index], prompt.finish_sent[index] = end, request.finished
    logprobs = tuple(request.logprobs[start:end]) if request.params.logprobs is not None else ()
    return TokenDelta(request.index, tuple(request.output[start:end]), logprobs, request.finish_reason,
                      request.stop_token)
