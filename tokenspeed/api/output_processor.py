"""A prompt's answers, made from the engine's token updates where the caller is: the API
server's process for a served request, ``LLM``'s for an offline one (as vLLM's output
processor and SGLang's detokenizer, off the engine's thread). Each completion's text,
kept tokens and final ``finish_reason`` are decided by its ``CompletionText``; the caller
tells the engine to finish the completions a stop string ended (``update``'s second value).
"""

from tokenspeed.api.completion_text import CompletionText
from tokenspeed.api.messages import Completed, TokenUpdate
from tokenspeed.api.text_updates import GroupUpdate
from tokenspeed.execution.outputs import CompletionOutput


class PromptOutput:
    def __init__(self, tokenizer, params, num_prompt_tokens: int, streamed: bool = True):
        """``streamed`` False: the answers' text is read only once final (``CompletionText``)."""
        self.at_end = not streamed and not params.stop   # no text to read, nor stop string to seek, before the end
        self.completions = [CompletionText(tokenizer, params, i, self.at_end) for i in range(params.n)]
        self.num_prompt_tokens = num_prompt_tokens
        self.num_output_tokens = 0       # the tokens its answers kept so far
        self.error: str | None = None
        self._open = params.n            # answers not final yet (counted: read per token)

    @property
    def finished(self) -> bool:
        """Every answer is final (or a failed step ended them all)."""
        return self._open == 0 or self.error is not None

    def update(self, update: TokenUpdate) -> tuple[GroupUpdate | None, list[int]]:
        """What the answers gained from the engine's ``update`` (None: nothing, as for the
        engine's own end of completions already final here), and the completions that a
        stop string ended here and the engine has yet to finish."""
        if self.finished:
            return None, []
        if update.error is not None:
            self.error = update.error
            return GroupUpdate((), True, self.num_prompt_tokens, self.num_output_tokens, update.error,
                               update.refused), []
        deltas, stopped = [], []
        for delta in update.deltas:
            gained = self.completions[delta.index].feed(delta)
            if gained is None:
                continue
            deltas.append(gained)
            self.num_output_tokens += len(gained.token_ids)
            if gained.finish_reason is not None:
                self._open -= 1
                if delta.finish_reason is None:
                    stopped.append(delta.index)
        if not deltas:
            return None, stopped
        return GroupUpdate(tuple(deltas), self.finished, self.num_prompt_tokens, self.num_output_tokens,
                           None), stopped

    def completed(self, figures: tuple[Completed, ...]) -> tuple[Completed, ...]:
        """The engine's figures of the finished completions, with the tokens each answer
        kept and its finish as decided here (the engine's, for an answer never final here)."""
        return tuple(Completed(len(c.token_ids), c.finish_reason or f.finish_reason, f.time_to_first_token,
                               f.time_per_output_token) for c, f in zip(self.completions, figures))

    def outputs(self) -> tuple[CompletionOutput, ...]:
        return tuple(c.output() for c in self.completions)
