"""The records that cross between the server's processes, typed: ``msgspec`` Structs, one
tagged union per direction (``ToEngine``: a client's work; ``FromEngine``: the engine's
word back), each encoded once to msgpack and decoded straight into its record.

Every wire record declares all its fields without defaults, and decodes with unknown
fields forbidden: a field added at one end and not the other is a decode error at the
other end, never a shifted or defaulted value. Records are ``array_like`` (a msgpack array
of their values, not a map of names): the per-step report (one per step per client, with
every open stream's delta) is smaller and quicker so, and a tagged union holds records
of one kind only.
``Prompt``, ``SamplingParams``, ``PromptLimits`` and ``TokenLogprobs`` travel as the attrs
records they are (msgspec encodes them by field name and, decoding, calls their
``__init__``): their validators run again on the receiving end.
"""

from typing import Any, Union

import msgspec

from tokenspeed.api.prompts import Prompt
from tokenspeed.execution.outputs import TokenLogprobs
from tokenspeed.scheduling.prompt_limits import PromptLimits
from tokenspeed.execution.sampling_params import SamplingParams


class Record(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True, gc=False):
    """A record that crosses between processes (or is a field of one). ``gc=False``: the
    records hold values, never themselves, so they need no cycle collection; untracked,
    a step's records cost the engine's thread less to build and the reader less to decode."""


class Submit(Record, tag=True):
    key: int                   # the caller's name for this prompt's requests
    prompt: Prompt
    params: SamplingParams
    client: int                # which of the loop's clients sent it (the relay sets it)
    at_end: bool               # its tokens wanted only when a completion ends (``EngineCore.add``)


class Abort(Record, tag=True):
    key: int
    client: int


class Finish(Record, tag=True):
    """A stop string ended completion ``index`` of ``key`` in the client's process (which
    decides stop strings): the engine ends it now, returning its pages."""
    key: int
    index: int
    client: int


class ClientGone(Record):
    """A client's connection closed: its requests are aborted, it gets no more reports.
    (The engine process's relay makes it; it crosses no process boundary.)"""
    client: int


class TokenDelta(Record):
    """The tokens one completion gained in a step (the engine sends no text: its clients
    detokenize); ``finish_reason`` once the engine has ended it, ``stop_token`` the token
    that did, its last: an end-of-sequence token or one of ``stop_token_ids`` (None for a
    length, an abort or a complete grammar)."""
    index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...]
    finish_reason: str | None
    stop_token: int | None


class Completed(Record):
    """One finished completion, for the server's metrics (seconds; None where undefined)."""
    num_output_tokens: int
    finish_reason: str
    time_to_first_token: float | None
    time_per_output_token: float | None


class TokenUpdate(Record):
    """A prompt's completions after a step; ``finished`` once the engine has ended all of
    them, with each one's figures in ``completed``; ``error`` when a step failed and took
    the request with it, or, ``refused``, when the request's own settings ended it (its
    constraints left it no token; the engine refused it): the caller's to mend."""
    deltas: tuple[TokenDelta, ...]
    finished: bool
    num_prompt_tokens: int
    error: str | None
    completed: tuple[Completed, ...]
    refused: bool


class EngineLoad(Record):
    running: int
    waiting: int
    pages_in_use: int


class StepReport(Record, tag=True):
    """One client's updates of a step, each with its prompt's key, and the engine's load."""
    updates: list[tuple[int, TokenUpdate]]
    load: EngineLoad


class EngineInfo(Record, tag=True):
    """What the HTTP process learns of the engine once it has started."""
    limits: PromptLimits
    has_tokenizer: bool
    sampling_defaults: dict[str, Any]   # the model's (``LLM.sampling_defaults``): a request's unset fields


class EngineFailed(Record, tag=True):
    message: str


class Heartbeat(Record, tag=True):
    """The engine process is running (sent to every client every ``HEARTBEAT_INTERVAL_S``)."""


ToEngine = Union[Submit, Abort, Finish]
FromEngine = Union[StepReport, Heartbeat, EngineInfo, EngineFailed]


class MismatchedRecord(TypeError):
    """A record that does not decode as this end's record of its type: the two ends'
    definitions differ (a field added or removed at one of them)."""


class RecordDecoder:
    """Decodes one direction's records; a record that does not match this end's
    definition of its type is a ``MismatchedRecord`` naming the type (as is one whose
    attrs record, rebuilt here, refuses a value: the sender built it around its checks)."""

    def __init__(self, union):
        self.decoder = msgspec.msgpack.Decoder(union)

    def decode(self, payload):
        try:
            return self.decoder.decode(payload)
        except msgspec.ValidationError as exc:
            problem = "has a value its record refuses" if isinstance(exc.__cause__, ValueError) else \
                "does not match this end's"
            raise MismatchedRecord(f"a {_type_name(payload)} record from the other process {problem}: {exc}") from exc


def _type_name(payload) -> str:
    """The tag of a record that failed to decode (its array's first value)."""
    try:
        values = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return "malformed"
    tagged = isinstance(values, list) and values and isinstance(values[0], str)
    return values[0] if tagged else "untagged"


def to_engine_decoder() -> RecordDecoder:
    """The engine process's end: what its clients send."""
    return RecordDecoder(ToEngine)


def from_engine_decoder() -> RecordDecoder:
    """A client's end: what the engine process sends."""
    return RecordDecoder(FromEngine)
