"""The README's Python tour runs as written, on the CPU with the embedded default model,
and prints what its comments promise: a comment ``# "... is 4."`` on a ``print`` line
promises that text in what its block prints (``...``: anything), and no completion it
makes is empty. The OpenAI client's block needs a running server and is left to
tests/test_server.py."""

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
PROMISE = re.compile(r'print\(.*#\s*"(.*?)"')


def tour() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    return [b for b in blocks if "base_url=" not in b]


def promises(block: str) -> list[re.Pattern]:
    """Each promised text as a pattern: its ``...`` match anything."""
    return [re.compile(".*?".join(re.escape(part.strip(" ")) for part in text.split("...") if part.strip(" ")),
                       re.S) for text in PROMISE.findall(block)]


def test_the_tour_promises_something():
    blocks = tour()
    assert len(blocks) >= 4 and sum(len(promises(b)) for b in blocks) >= 3
    assert promises(blocks[0])[1].search("The answer is 4.") and not promises(blocks[0])[1].search("4")


@pytest.mark.slow
def test_the_readme_tour_prints_what_it_promises():
    from tokenspeed.models import default_model_path
    try:
        default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    namespace: dict = {}
    for block in tour():
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(block, str(README), "exec"), namespace)
        assert printed.getvalue().strip(), f"this README block printed nothing:\n{block}"
        for promise in promises(block):
            assert promise.search(printed.getvalue()), (promise.pattern, printed.getvalue())
        assert all(o.text for o in completions(namespace)), [o.text for o in completions(namespace)]


def completions(namespace: dict) -> list:
    """The completions the tour holds: its ``RequestOutput`` values and lists of them."""
    import tokenspeed as ts
    values = [v for v in namespace.values() if isinstance(v, (list, ts.RequestOutput))]
    found = [v for value in values for v in (value if isinstance(value, list) else [value])]
    return [o for o in found if isinstance(o, ts.RequestOutput)]
