"""``GET /v1/models`` and the model a request names: the list's shape, and a model not
served here is a 404 ``NotFoundError`` (as vLLM answers), on every endpoint."""

import openai
import pytest

from openai_http import MODEL, assert_error


def test_the_model_list_has_openais_shape(client):
    [model] = client.models.list().data
    assert model.id == MODEL and model.object == "model" and model.owned_by == "tokenspeed"
    assert isinstance(model.created, int) and model.max_model_len == 256


def test_the_model_list_needs_the_key(api):
    assert_error(api.request("GET", "/v1/models", key=None), 401, "AuthenticationError")


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "x"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ("/tokenize", {"prompt": "x"}),
    ("/detokenize", {"tokens": [5]}),
])
def test_an_unknown_model_is_404(api, path, body):
    assert_error(api.post(path, {**body, "model": "gpt-9"}), 404, "NotFoundError", "model", "'gpt-9'")


def test_the_client_library_raises_not_found(client):
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.completions.create(model="gpt-9", prompt="x")


def test_no_model_named_means_the_served_one(api):
    assert api.post("/v1/completions", {"prompt": "x", "max_tokens": 1}).json()["model"] == MODEL


def test_one_model_is_read_by_its_name(client, api):
    model = client.models.retrieve(MODEL)
    assert (model.id, model.object, model.max_model_len) == (MODEL, "model", 256)
    assert_error(api.request("GET", "/v1/models/gpt-9"), 404, "NotFoundError", "model", "'gpt-9'")


def test_a_chat_that_fills_the_context_is_refused_as_too_long(api):
    """No max_tokens sent: the prompt is what is too long, not a max_tokens of 1."""
    long = "the sea " * 200
    assert_error(api.post("/v1/chat/completions", {"messages": [{"role": "user", "content": long}]}), 400,
                 "BadRequestError", "messages", "leave no room for an output token")
