"""``POST /tokenize`` and ``/detokenize``: ids as the offline tokenizer gives them, the
chat template's prompt, the key, refusals, and tokenizing off the event loop."""

import threading

import httpx
import pytest

from openai_http import assert_error

HELLO = [{"role": "user", "content": "Hello!"}]


def test_tokenize_and_detokenize_round_trip(api, llm):
    body = api.post("/tokenize", {"prompt": "Hello world"}).json()
    assert body["tokens"] == llm.tokenizer.encode("Hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 256
    assert api.post("/detokenize", {"tokens": body["tokens"]}).json() == {"prompt": "Hello world"}


def test_tokenize_messages_is_the_chat_prompt(api, llm):
    body = api.post("/tokenize", {"messages": HELLO}).json()
    assert body["tokens"] == llm.tokenizer.apply_chat_template(HELLO, add_generation_prompt=True)


@pytest.mark.parametrize("path, body", [("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [5]})])
def test_both_need_the_key(api, path, body):
    assert_error(api.post(path, body, key=None), 401, "AuthenticationError")
    assert_error(api.post(path, body, key="nope"), 401, "AuthenticationError")


def test_refusals_name_the_field(api):
    assert_error(api.post("/tokenize", {}), 400, "BadRequestError", "prompt", "exactly one")
    assert_error(api.post("/tokenize", {"prompt": "x", "messages": HELLO}), 400, "BadRequestError", "prompt")
    assert_error(api.post("/detokenize", {"tokens": [10**9]}), 400, "BadRequestError", "tokens", "vocabulary")


class HeldTokenizer:
    """The server's tokenizer, with ``encode`` held until released: a long tokenization."""

    def __init__(self, tokenizer):
        self.tokenizer, self.entered, self.release = tokenizer, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def encode(self, *args, **kwargs):
        self.entered.set()
        assert self.release.wait(30)
        return self.tokenizer.encode(*args, **kwargs)


def test_tokenizing_leaves_the_event_loop_serving(server_app, api, base_url):
    """While one request's text is being tokenized, the server answers others (it froze
    every stream while three 3.9 MB prompts were tokenized on its event loop)."""
    server = server_app.state.server
    held = HeldTokenizer(server.tokenizer)
    server.tokenizer, answers = held, []
    try:
        worker = threading.Thread(target=lambda: answers.append(api.post("/tokenize", {"prompt": "slow"})))
        worker.start()
        assert held.entered.wait(30)
        assert httpx.get(f"{base_url}/health", timeout=10).status_code == 200
        assert api.post("/detokenize", {"tokens": [5, 6]}).status_code == 200
    finally:
        held.release.set()
        worker.join(30)
        server.tokenizer = held.tokenizer
    assert answers[0].status_code == 200 and answers[0].json()["count"] == len(held.tokenizer.encode("slow"))


def test_detokenize_keeps_special_tokens_as_vllm_does(api, llm):
    """A chat prompt's ids come back with their template markers (vLLM decodes them too)."""
    ids = api.post("/tokenize", {"messages": HELLO}).json()["tokens"]
    text = api.post("/detokenize", {"tokens": ids}).json()["prompt"]
    assert text == llm.tokenizer.decode(ids, skip_special_tokens=False)
    assert text != llm.tokenizer.decode(ids)   # the template's markers are special tokens
