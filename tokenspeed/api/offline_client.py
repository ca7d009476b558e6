"""``LLM``'s requests in its own process: queued through the engine-client interface
(``EngineCore``), stepped on the thread of whichever caller waits for them, and answered
by a ``PromptOutput`` each, as the server's API process answers its requests.

Several threads may share one: their requests join the same running batch (each caller
steps the engine under one lock while its own requests are unfinished) and each gets
exactly its own outputs.
"""

import itertools
import threading

import attrs

from tokenspeed.api.engine_core import EngineCore
from tokenspeed.api.output_processor import PromptOutput
from tokenspeed.api.prompts import Prompt
from tokenspeed.api.request_figures import prompt_metrics
from tokenspeed.api.token_texts import with_token_texts
from tokenspeed.engine.core import Engine
from tokenspeed.errors import RefusedRequest
from tokenspeed.execution.outputs import RequestOutput
from tokenspeed.scheduling.request import Request
from tokenspeed.execution.sampling_params import SamplingParams


@attrs.frozen
class LivePrompt:
    """A prompt queued here: its requests in the engine, and its answers."""
    requests: list[Request]
    output: PromptOutput


class OfflineClient:
    def __init__(self, engine: Engine, tokenizer):
        """``tokenizer`` None: answers of token ids only."""
        self.engine, self.tokenizer = engine, tokenizer
        self.core = EngineCore(engine)
        self._lock = threading.Lock()
        self._prompts: dict[int, LivePrompt] = {}    # by their key in ``core``
        self._keys = itertools.count()
        self._failures, self._failure = 0, None   # failed steps so far, and the last error

    def add(self, prompts: list[Prompt], params: list[SamplingParams], streamed: bool = True) -> list[int]:
        """Queue checked prompts; their keys. All or none: a prompt refused takes those
        queued before it out again. ``streamed`` False: their text is read only in
        ``answer`` (``PromptOutput``)."""
        with self._lock:
            keys = []
            try:
                for prompt, sp in zip(prompts, params):
                    keys.append(next(self._keys))
                    output = PromptOutput(self.tokenizer, sp, len(prompt.token_ids), streamed)
                    requests = self.core.add(keys[-1], prompt.token_ids, sp, at_end=output.at_end)
                    self._prompts[keys[-1]] = LivePrompt(requests, output)
            except ValueError:
                for key in keys:
                    self.core.abort(key)
                    self._prompts.pop(key, None)
                raise
            return keys

    def requests(self, key: int) -> list[Request]:
        return self._prompts[key].requests

    def output(self, key: int) -> PromptOutput:
        return self._prompts[key].output

    def serve(self, requests: list[Request], on_finish, steps: int | None = None) -> None:
        """Step the engine until ``requests`` finish (or ``steps`` steps ran); every step
        advances every caller's requests and their text, so a request may finish in a
        step another caller ran: each is reported to ``on_finish`` once, whoever stepped."""
        unreported, done, failures, scanned = list(requests), 0, self._failures, None
        while True:
            if self.engine.num_finished != scanned:   # a scan of thousands of requests is
                scanned = self.engine.num_finished     # host time of every step: only on news
                for request in [r for r in unreported if r.finished]:
                    on_finish(request)
                unreported = [r for r in unreported if not r.finished]
            if not unreported or (steps is not None and done >= steps):
                return
            with self._lock:
                if self._failures != failures and any(r.finish_reason == "abort" for r in unreported):
                    raise RuntimeError("the engine failed in a step another caller ran; "
                                       "its requests were aborted") from self._failure
                if self.engine.num_finished == scanned:   # else some may be done: rescan first
                    self._step()
                    done += 1

    def step(self) -> None:
        """One engine step for everyone's requests, and their answers. A step that fails
        aborts every request then in the engine, and raises."""
        with self._lock:
            self._step()

    def _step(self) -> None:
        try:
            updates = self.core.step()
        except BaseException as exc:
            self._failures, self._failure = self._failures + 1, exc
            raise
        for key, update in updates:
            live = self._prompts.get(key)
            if live is not None:
                for index in live.output.update(update)[1]:   # a stop string ended it
                    self.core.finish(key, index)

    def raise_failure(self, keys: list[int]) -> None:
        """Refuse the call, forgetting its prompts, where the engine ended one alone with an
        error (its constraints left it no token): as a prompt refused at the door refuses
        its whole call."""
        with self._lock:
            failed = [(i, self._prompts[k].output.error) for i, k in enumerate(keys)
                      if k in self._prompts and self._prompts[k].output.error is not None]
        if failed:
            self.drop(keys)
            index, error = failed[0]
            raise RefusedRequest(f"prompt {index}: {error}", field="structured_outputs", value=None, limit=None)

    def abort(self, requests: list[Request]) -> None:
        """Finish the unfinished ``requests`` now, returning their pages."""
        with self._lock:
            for request in requests:
                self.engine.finish(request, "abort")

    def release(self, requests: list[Request]) -> None:
        """Forget the answers of the prompts of finished ``requests``."""
        ours = set(map(id, requests))
        with self._lock:
            for key in [k for k, live in self._prompts.items() if id(live.requests[0]) in ours]:
                del self._prompts[key]

    def drop(self, keys: list[int]) -> None:
        """End the prompts of ``keys`` (their pages return) and forget them."""
        with self._lock:
            for key in keys:
                self.core.abort(key)
                self._prompts.pop(key, None)

    def answer(self, prompt: Prompt, key: int) -> RequestOutput:
        """A finished prompt's output (forgotten here)."""
        with self._lock:
            live = self._prompts.pop(key)
        completions = tuple(with_token_texts(c, self.tokenizer) for c in live.output.outputs())
        metrics = prompt_metrics(live.requests, len(prompt.token_ids), live.output.num_output_tokens)
        return RequestOutput(live.requests[0].id, prompt.token_ids, completions, metrics, prompt.text)
