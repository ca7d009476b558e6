"""One check of chat messages for ``LLM.chat`` and the server: the roles, contents and
fields each accepts, refused by path and value otherwise."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenspeed.api.chat_messages import ROLES, conversations, template_messages

texts = st.text(max_size=20)
contents = st.one_of(texts, st.lists(texts.map(lambda t: {"type": "text", "text": t}), max_size=3))
messages = st.one_of(   # an assistant's content may be None (its tool calls are the message)
    st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": contents},
                          optional={"name": st.one_of(st.none(), texts)}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.none()}))


@given(st.lists(messages, min_size=1, max_size=4))
def test_every_accepted_message_reaches_the_template_as_text(conversation):
    checked = template_messages(conversation)
    for given_message, message in zip(conversation, checked):
        content = given_message["content"]
        assert message["content"] == (content if isinstance(content, str) else
                                      "\n".join(p["text"] for p in content or []))
        assert message["role"] == ("system" if given_message["role"] == "developer" else given_message["role"])
        assert message.get("name") == given_message.get("name")
    assert conversations(conversation) == [checked] == conversations([conversation])


@pytest.mark.parametrize("bad, message", [
    ([], "messages must be a list of message dicts"),
    ("hi", "messages must be a list of message dicts"),
    ([{"role": "user", "content": "a"}, "b"], r"messages\[1\] must be a dict with 'role' and 'content', got str 'b'"),
    ([[{"role": "user", "content": "a"}], []], r"messages\[1\] must be a non-empty list of message dicts, got list \[\]"),
    ([{"role": "user"}], r"messages\[0\].content: a user message needs content"),
    ([{"role": "tool", "content": None, "tool_call_id": "1"}], r"messages\[0\].content: a tool message needs content"),
    ([{"content": "a"}], r"messages\[0\].role=None: must be one of system, user"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
     r"messages\[0\].content\[0\] is an 'image_url' part: the models served here read text alone"),
    ([{"role": "user", "content": [{"type": "txt", "text": "x"}]}],
     r"messages\[0\].content\[0\] must be \{'type': 'text', 'text': str\}"),
    ([{"role": "user", "content": "a", "name": 3}], r"messages\[0\].name=3: must be a string"),
    ([{"role": "user", "content": "hi \ud83d"}], r"messages\[0\].content: not valid Unicode \(a lone surrogate"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "\udfff"}]}],
     r"messages\[0\].content\[1\]: not valid Unicode"),
])
def test_bad_messages_are_named_by_path(bad, message):
    with pytest.raises((TypeError, ValueError), match=message):
        conversations(bad)


def test_an_assistant_message_as_openais_client_dumps_it_goes_back_in():
    """``message.model_dump()`` of a reply: its null fields accepted, a refusal its content."""
    dumped = {"role": "assistant", "content": "Hi.", "refusal": None, "annotations": None, "audio": None,
              "function_call": None, "tool_calls": None}
    refused = {**dumped, "content": None, "refusal": "I can't help with that."}
    checked = template_messages([{"role": "user", "content": "hi"}, dumped, refused])
    assert checked[1] == {"role": "assistant", "content": "Hi."}
    assert checked[2] == {"role": "assistant", "content": "I can't help with that."}


@pytest.mark.parametrize("field, value, message", [
    ("audio", {"id": "a1"}, r"messages\[0\].audio=dict \{'id': 'a1'\}: audio output .* only null is accepted"),
    ("function_call", {"name": "f", "arguments": "{}"},
     r"messages\[0\].function_call=dict .*: function_call \(deprecated"),
    ("refusal", 3, r"messages\[0\].refusal=3: must be a string"),
    ("annotations", "cited", r"messages\[0\].annotations must be a list, got str 'cited'"),
])
def test_what_a_text_model_never_wrote_is_refused_unless_null(field, value, message):
    with pytest.raises((TypeError, ValueError), match=message):
        template_messages([{"role": "assistant", "content": None, field: value}])


def test_a_refusal_belongs_to_an_assistant():
    with pytest.raises(ValueError, match=r"messages\[0\].refusal: only a message of role 'assistant'"):
        template_messages([{"role": "user", "content": "a", "refusal": "no"}])


def test_content_and_a_refusal_together_are_refused():
    with pytest.raises(ValueError, match=r"messages\[0\] has both content and a refusal \(str 'no'\): give one"):
        template_messages([{"role": "assistant", "content": "", "refusal": "no"}])
