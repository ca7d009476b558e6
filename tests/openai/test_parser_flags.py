"""``tokenspeed serve --tool-call-parser / --reasoning-parser``: vLLM's names, ``none`` to
turn one off, and, left out, the formats the chat template teaches; an unknown name ends
the command with one line before any engine starts."""

import pytest

from tokenspeed.cli import serve_cmd
from tokenspeed.cli.main import main, parser
from tokenspeed.server.openai.chat_parsers import ChatParsers, ParserFlags

QWEN3_LIKE = "{% if enable_thinking %}<think>{% endif %}<tool_call>"


def test_the_parser_flags_default_to_the_chat_templates_formats():
    assert ParserFlags().resolve(QWEN3_LIKE) == ChatParsers("hermes", "qwen3")
    assert ParserFlags("mistral", "none").resolve(QWEN3_LIKE) == ChatParsers("mistral", None)
    assert ParserFlags("none", "deepseek_r1").resolve(None) == ChatParsers(None, "deepseek_r1")
    assert ParserFlags().resolve(None) == ChatParsers()


def test_the_serve_flags_become_the_servers_parser_flags():
    args = parser().parse_args(["serve", "--tool-call-parser", "llama3_json", "--reasoning-parser", "qwen3"])
    assert serve_cmd.parser_flags(args) == ParserFlags("llama3_json", "qwen3")
    assert serve_cmd.parser_flags(parser().parse_args(["serve"])) == ParserFlags()


@pytest.mark.parametrize("flag, says", [("--tool-call-parser", "--tool-call-parser='hermez': unknown; choose one "
                                         "of hermes, llama3_json, mistral"),
                                        ("--reasoning-parser", "--reasoning-parser='hermez': unknown")])
def test_an_unknown_parser_ends_serve_with_one_line(capsys, flag, says):
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--device", "cpu", flag, "hermez"])
    assert says in str(exited.value)
