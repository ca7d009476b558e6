"""One OpenAI-compatible server for the session's endpoint checks: the tiny text model
(a real tokenizer and chat template over random weights), an API key, one allowed CORS
origin; and the offline ``LLM`` of the same model, for the answers it must equal."""

import functools

import openai
import pytest

import tokenspeed as ts
from tokenspeed.server.engine_process import EngineSpec
from tokenspeed.server.openai.access import Access
from tokenspeed.server.openai.server import create_app

from openai_http import KEY, MODEL, ORIGIN, Api
from serving import running
from text_models import text_model_dir

OPTIONS = dict(page_size=4, max_num_seqs=8, max_model_len=256)


@pytest.fixture(scope="session")
def llm():
    return ts.LLM(text_model_dir(), **OPTIONS)


@pytest.fixture(scope="session")
def server_app():
    path = str(text_model_dir())
    spec = EngineSpec(functools.partial(ts.LLM, path, **OPTIONS), path)
    return create_app(spec, MODEL, api_key=KEY, access=Access(allowed_origins=(ORIGIN,), request_chat_template=True))


@pytest.fixture(scope="session")
def base_url(server_app):
    with running(server_app) as url:
        yield url


@pytest.fixture(scope="session")
def api(base_url):
    return Api(base_url)


@pytest.fixture(scope="session")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)
