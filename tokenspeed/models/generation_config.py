"""A model's own sampling defaults, from the ``generation_config.json`` of its directory.

Model authors tune these (an instruct model's temperature and top_p, say), and vLLM
serves them as the defaults of every request that does not set a field; tokenspeed does
the same in Python, on the command line and in the server. The fields taken are vLLM's
(``get_diff_sampling_param``): ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty`` and ``max_new_tokens`` (as ``max_tokens``); ``do_sample`` is not
read, as vLLM does not. A GGUF file has no such file: its defaults are ``SamplingParams``'
own. The values are returned as found; ``SamplingParams`` checks their ranges.
"""

import json
import numbers
from pathlib import Path

FILE_NAME = "generation_config.json"
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(model) -> dict[str, float | int]:
    """``SamplingParams`` keyword arguments from ``model``'s generation_config.json (a
    model directory's; empty for a GGUF file, a directory without one, or a model that
    is not a path)."""
    if not isinstance(model, (str, Path)) or not (Path(model) / FILE_NAME).is_file():
        return {}
    path = Path(model) / FILE_NAME
    found = _read(path)
    defaults = {ours: found[theirs] for theirs, ours in FIELDS.items() if found.get(theirs) is not None}
    for name, value in defaults.items():
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise ValueError(f"{path}: {_their_name(name)}={value!r} is not a number")
    return defaults


def _read(path: Path) -> dict:
    try:
        found = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a JSON file ({exc})") from exc
    if not isinstance(found, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(found).__name__}")
    return found


def _their_name(ours: str) -> str:
    return next(theirs for theirs, name in FIELDS.items() if name == ours)
