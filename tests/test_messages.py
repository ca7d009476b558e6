"""The records between the server's processes: every record crosses whole and typed, and
a record whose definition differs between the two ends (a field added or removed at
one) is a decode error naming its type at the other end, never a shifted value."""

import msgspec
import pytest
from hypothesis import given, settings, strategies as st

import tokenspeed as ts
from tokenspeed.api import messages
from tokenspeed.server.channel import HEADER, frame
from tokenspeed.api.messages import (Abort, Completed, EngineFailed, EngineInfo, EngineLoad, Finish, Heartbeat,
                                             MismatchedRecord, Record, StepReport, Submit, TokenDelta, TokenUpdate)
from tokenspeed.api.prompts import Prompt
from tokenspeed.execution.outputs import TokenLogprobs
from tokenspeed.scheduling.prompt_limits import PromptLimits


def step_report() -> StepReport:
    logprobs = (TokenLogprobs(5, -0.25, {5: -0.25, 9: -2.0}, {5: "a", 9: "b"}, 1),)
    delta = TokenDelta(1, (5,), logprobs, "stop", 9)
    update = TokenUpdate((delta,), True, 4, None, (Completed(1, "stop", 0.5, None),), False)
    return StepReport([(7, update)], EngineLoad(1, 0, 3))


SAMPLES = {
    Submit: Submit(3, Prompt((1, 2, 3), "abc"), ts.SamplingParams(temperature=0.5, stop=("x",), n=2), 0, False),
    Abort: Abort(3, 0),
    Finish: Finish(3, 1, 0),
    StepReport: step_report(),
    Heartbeat: Heartbeat(),
    EngineInfo: EngineInfo(PromptLimits(100, 256, 4, 63, (0, 16), 32, (2, 7)), True, {"temperature": 0.6}),
    EngineFailed: EngineFailed("boom"),
}
DECODERS = {Submit: messages.to_engine_decoder, Abort: messages.to_engine_decoder, Finish: messages.to_engine_decoder}


def decoder_of(kind):
    return DECODERS.get(kind, messages.from_engine_decoder)()


def payload(record) -> bytes:
    return frame(record)[HEADER.size:]


@pytest.mark.parametrize("kind", list(SAMPLES), ids=lambda kind: kind.__name__)
def test_every_record_crosses_whole_and_typed(kind):
    record = SAMPLES[kind]
    decoded = decoder_of(kind).decode(payload(record))
    assert type(decoded) is kind and decoded == record


def variant(kind, fields: list) -> type:
    """``kind`` as another end might define it: the same name (its tag), other fields."""
    return msgspec.defstruct(kind.__name__, fields, bases=(Record,), tag=True)


def with_field_added(kind) -> type:
    return variant(kind, [(f.name, f.type) for f in msgspec.structs.fields(kind)] + [("added", int)])


def with_last_field_removed(kind) -> type:
    return variant(kind, [(f.name, f.type) for f in msgspec.structs.fields(kind)][:-1])


def as_variant(record, other: type):
    values = [getattr(record, f) for f in other.__struct_fields__ if f != "added"]
    return other(*values, *([1] if "added" in other.__struct_fields__ else []))


FIELDED = [kind for kind in SAMPLES if kind.__struct_fields__]


@pytest.mark.parametrize("change", [with_field_added, with_last_field_removed], ids=lambda c: c.__name__)
@pytest.mark.parametrize("kind", FIELDED, ids=lambda kind: kind.__name__)
def test_a_field_added_or_removed_at_the_sender_is_an_error_naming_the_type(kind, change):
    sent = as_variant(SAMPLES[kind], change(kind))
    with pytest.raises(MismatchedRecord, match=f"a {kind.__name__} record from the other process does not match"):
        decoder_of(kind).decode(payload(sent))


@pytest.mark.parametrize("change", [with_field_added, with_last_field_removed], ids=lambda c: c.__name__)
@pytest.mark.parametrize("kind", FIELDED, ids=lambda kind: kind.__name__)
def test_a_field_added_or_removed_at_the_receiver_is_an_error_naming_the_type(kind, change):
    receiver = messages.RecordDecoder(change(kind))
    with pytest.raises(MismatchedRecord, match=f"a {kind.__name__} record from the other process does not match"):
        receiver.decode(payload(SAMPLES[kind]))


def test_a_nested_record_of_another_shape_fails_its_report_not_a_shifted_value():
    """A ``TokenUpdate`` without its last field, inside a report: the report fails to
    decode (naming it and where), rather than its values sliding one place."""
    short = variant(TokenUpdate, [(f.name, f.type) for f in msgspec.structs.fields(TokenUpdate)][:-1])
    untagged = msgspec.defstruct("TokenUpdate", [(f, object) for f in short.__struct_fields__],
                                 bases=(Record,))
    update = untagged(*[getattr(step_report().updates[0][1], f) for f in short.__struct_fields__])
    sent = StepReport([(7, update)], EngineLoad(1, 0, 3))
    with pytest.raises(MismatchedRecord, match=r"a StepReport record .* at `\$\[1\]\[0\]\[1\]`"):
        messages.from_engine_decoder().decode(payload(sent))


def test_sampling_params_are_checked_again_where_they_arrive():
    """The engine's end rebuilds ``SamplingParams`` through its checks: a record built
    around them is refused there, naming the value."""
    bad = ts.SamplingParams(temperature=1.0, max_tokens=4)
    object.__setattr__(bad, "top_k", 2**63)
    with pytest.raises(MismatchedRecord, match="a Submit record .* refuses: top_k=9223372036854775808"):
        messages.to_engine_decoder().decode(payload(Submit(1, Prompt((1,)), bad, 0, False)))


def test_a_record_of_the_other_direction_is_refused():
    with pytest.raises(MismatchedRecord, match="a Heartbeat record"):
        messages.to_engine_decoder().decode(payload(Heartbeat()))


token_logprobs = st.builds(TokenLogprobs, st.integers(0, 1 << 20), st.floats(allow_nan=False, max_value=0),
                           st.dictionaries(st.integers(0, 1 << 20), st.floats(allow_nan=False, max_value=0)),
                           st.none(), st.one_of(st.none(), st.integers(0, 20)))
deltas = st.builds(TokenDelta, st.integers(0, 100), st.lists(st.integers(0, 1 << 20)).map(tuple),
                   st.lists(token_logprobs, max_size=3).map(tuple), st.sampled_from([None, "stop", "length"]),
                   st.one_of(st.none(), st.integers(0, 1 << 20)))
completions = st.builds(Completed, st.integers(0, 1000), st.sampled_from(["stop", "length", "abort"]),
                        st.one_of(st.none(), st.floats(0, 10)), st.one_of(st.none(), st.floats(0, 10)))
updates = st.builds(TokenUpdate, st.lists(deltas, max_size=3).map(tuple), st.booleans(), st.integers(0, 1000),
                    st.one_of(st.none(), st.text()), st.lists(completions, max_size=2).map(tuple))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1 << 40), updates), max_size=4),
       st.builds(EngineLoad, st.integers(0, 64), st.integers(0, 64), st.integers(0, 4096)))
def test_any_report_decodes_to_itself(report_updates, load):
    report = StepReport(report_updates, load)
    assert messages.from_engine_decoder().decode(payload(report)) == report
