"""The two records a step passes between the scheduler, the runners and the engine (as
vLLM's ``SchedulerOutput`` and ``ModelRunnerOutput``): what was decided, and what the
runner produced; and a launched step not read yet."""

import attrs

from tokenspeed.backends.metadata import DecodeColumns
from tokenspeed.execution.outputs import TokenLogprobs
from tokenspeed.scheduling.request import Request
from tokenspeed.execution.token_column import FedRows


@attrs.frozen
class ScheduledBatch:
    """One step's rows: a chunk of ``chunk_lens[i]`` new tokens of ``requests[i]`` each (an
    extend batch), or one row each (a decode batch). A decode step chained on the one
    before keeps that step's rows moved on a position (``columns``: ``decode_chain``)."""
    kind: str                          # "extend" | "decode"
    requests: tuple[Request, ...]
    chunk_lens: tuple[int, ...]        # new tokens per request this step
    columns: DecodeColumns | None = None


@attrs.frozen
class RunnerOutput:
    """What a launched step produced, read on the host: per sampled row, its token and
    its log-probabilities (None where the row did not ask)."""
    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprobs | None, ...]

    @classmethod
    def read(cls, future) -> "RunnerOutput":
        """Wait for the step's tokens (``StepFuture``) and read them."""
        return cls(tuple(future.tokens()), tuple(future.logprobs()))


@attrs.frozen(eq=False)
class AwaitingMasks:
    """A launched step's first stage (its runner's ``forward``: the model); its rows are
    drawn once the host has their masks, which need the tokens of the step before
    (``engine.constrained_steps``)."""
    forward: object


@attrs.frozen
class InFlight:
    """A launched step whose tokens the host has not read: its batch, the requests of its
    sampled rows in row order, and its future (``AwaitingMasks`` until its second stage is
    launched). ``fed``: a chained decode step's fed rows,
    kept for the next step of the chain while its rows stay the same."""
    batch: ScheduledBatch
    sampled: tuple[Request, ...]
    future: object
    fed: FedRows | None = None

    @property
    def awaits_masks(self) -> bool:
        return isinstance(self.future, AwaitingMasks)

    @property
    def columns(self) -> DecodeColumns | None:
        return self.batch.columns
