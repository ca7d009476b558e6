"""What every endpoint shares: the API key on every route but /health and /metrics,
CORS for the named origins only (a preflight needs no key), a JSON body (415 for any
other declared type or a compressed body), and OpenAI's error body for every error,
routing's included."""

import gzip
import json

import pytest
from fastapi.testclient import TestClient

from tokenspeed.server.openai.access import Access
from tokenspeed.server.openai.server import Server, server_app

from openai_http import KEY, ORIGIN, assert_error

COMPLETION = {"prompt": "x", "max_tokens": 1}


@pytest.mark.parametrize("method, path", [("GET", "/v1/nothing"), ("POST", "/v2/completions"), ("GET", "/")])
def test_an_unknown_route_is_an_openai_404(api, method, path):
    assert_error(api.request(method, path), 404, "NotFoundError", None, "Not Found")


@pytest.mark.parametrize("method, path", [("GET", "/v1/completions"), ("DELETE", "/v1/models"),
                                          ("PUT", "/tokenize")])
def test_a_wrong_method_is_an_openai_405(api, method, path):
    response = api.request(method, path)
    assert_error(response, 405, "MethodNotAllowedError", None, "Method Not Allowed")
    assert response.headers["allow"]


@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("POST", "/v1/completions"),
                                          ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/v1/nothing")])
def test_every_route_but_health_and_metrics_needs_the_key(api, method, path):
    assert_error(api.request(method, path, key=None), 401, "AuthenticationError")
    assert_error(api.request(method, path, key="wrong"), 401, "AuthenticationError")


def test_health_and_metrics_need_no_key(api):
    assert api.request("GET", "/health", key=None).status_code == 200
    assert api.request("HEAD", "/health", key=None).status_code == 200
    assert "tokenspeed_" in api.request("GET", "/metrics", key=None).text


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonp"])
def test_a_body_not_declared_json_is_415(api, content_type):
    response = api.post("/v1/completions", COMPLETION, content_type=content_type)
    assert_error(response, 415, "UnsupportedMediaTypeError", None, "application/json")


@pytest.mark.parametrize("encoding", ["gzip", "br, gzip"])
def test_a_compressed_body_is_415_naming_its_encoding(api, encoding):
    body = gzip.compress(json.dumps(COMPLETION).encode())
    response = api.post("/v1/completions", body, headers={"Content-Encoding": encoding})
    assert_error(response, 415, "UnsupportedMediaTypeError", None, f"Content-Encoding {encoding!r}")


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON"])
def test_a_json_body_is_served(api, content_type):
    assert api.post("/v1/completions", COMPLETION, content_type=content_type).status_code == 200


def test_a_preflight_from_an_allowed_origin_needs_no_key(api):
    response = api.request("OPTIONS", "/v1/chat/completions", key=None, headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert response.status_code == 200 and response.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in response.headers["access-control-allow-methods"]


def test_answers_to_an_allowed_origin_carry_cors_headers(api):
    response = api.post("/v1/completions", COMPLETION, headers={"Origin": ORIGIN})
    assert response.status_code == 200 and response.headers["access-control-allow-origin"] == ORIGIN
    other = api.post("/v1/completions", COMPLETION, headers={"Origin": "http://evil.example"})
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers


def test_a_preflight_from_another_origin_is_not_allowed(api):
    response = api.request("OPTIONS", "/v1/completions", key=None, headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert response.status_code == 400 and "access-control-allow-origin" not in response.headers


def bare_app(access: Access = Access()):
    """The routes and middleware alone: no engine is started (no lifespan), which the
    checks below never reach."""
    return TestClient(server_app(Server(None, None, "m", KEY), access), raise_server_exceptions=False)


def test_without_origins_no_cors_header_is_sent_and_a_preflight_needs_no_key():
    client = bare_app()
    response = client.options("/v1/completions", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert response.status_code == 405 and response.json()["error"]["type"] == "MethodNotAllowedError"
    assert not any(name.startswith("access-control-") for name in response.headers)


def test_metrics_can_need_the_key():
    client = bare_app(Access(metrics_need_key=True))
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_cors_methods_and_headers_are_those_named():
    client = bare_app(Access(allowed_origins=("*",), allowed_methods=("POST",), allowed_headers=("authorization",)))
    allowed = client.options("/v1/completions", headers={
        "Origin": "http://a.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization"})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "*"
    refused = client.options("/v1/completions", headers={
        "Origin": "http://a.example", "Access-Control-Request-Method": "DELETE"})
    assert refused.status_code == 400


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_a_requests_own_chat_template_needs_the_operators_trust(path):
    """The server renders it, and a two-line template can build a prompt of gigabytes:
    refused by name unless ``--trust-request-chat-template`` (the trusted path: the chat
    tests' server, test_chat_completions)."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "chat_template": "{{ 'ab ' * 30000000 }}"}
    response = bare_app().post(path, json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert_error(response, 400, "BadRequestError", "chat_template", "--trust-request-chat-template")
