"""The types and ranges of the config.json fields tokenspeed reads.

A value of the wrong type does not fail where it is read: a string ``rms_norm_eps`` fails
deep inside compilation, a string ``tie_word_embeddings`` is simply true, a head count
that does not divide the hidden size surfaces as a projection's shape mismatch. Each is
checked here, first, so the error names the field, its value and what is accepted.
"""

import math

import attrs

RUNNABLE_DTYPES = ("float32", "float16", "bfloat16")
DTYPE_FIELDS = ("dtype", "torch_dtype")  # transformers 5 writes ``dtype``, older ones ``torch_dtype``


@attrs.frozen
class Accepted:
    """What one field accepts: a type (``int``, ``float``, ``bool``), a lower bound (of
    the number), whether the bound itself is allowed, and an upper bound (inclusive)."""
    kind: type
    low: float | None = None
    inclusive: bool = True
    high: float | None = None

    def admits(self, value) -> bool:
        if self.kind is bool or isinstance(value, bool):  # JSON's true is an int to Python
            return isinstance(value, bool) and self.kind is bool
        numbers = (int,) if self.kind is int else (int, float)
        return isinstance(value, numbers) and math.isfinite(value) and self._in_range(value)

    def _in_range(self, value) -> bool:
        above = self.low is None or value > self.low or (self.inclusive and value == self.low)
        return above and (self.high is None or value <= self.high)

    def describe(self) -> str:
        kind = {int: "an integer", float: "a finite number", bool: "true or false"}[self.kind]
        bound = "" if self.low is None else f" {'>=' if self.inclusive else '>'} {self.low:g}"
        return kind + bound + ("" if self.high is None else f" and <= {self.high:,}")


COUNT, SIZE = Accepted(int, 0), Accepted(int, 1)
# Every position's rotary angles are tabled at load: a context of 2^24 tokens (past any
# model's) is already a table of gigabytes.
MAX_POSITIONS = 2**24
FIELDS = {
    "vocab_size": SIZE, "hidden_size": SIZE, "intermediate_size": SIZE, "num_hidden_layers": SIZE,
    "num_attention_heads": SIZE, "num_key_value_heads": SIZE, "head_dim": SIZE,
    "max_position_embeddings": Accepted(int, 1, high=MAX_POSITIONS), "num_kv_shared_layers": COUNT,
    "rms_norm_eps": Accepted(float, 0), "rope_theta": Accepted(float, 0, inclusive=False),
    "tie_word_embeddings": Accepted(bool), "attention_bias": Accepted(bool),
    "use_sliding_window": Accepted(bool),
}


def invalid(field: str, value, accepted: str) -> ValueError:
    return ValueError(f"config field {field}={value!r} is not valid: expected {accepted}")


def check_values(hf: dict) -> None:
    """Every field tokenspeed reads has a value of its type and range (``None``: absent)."""
    for field in ("rope_parameters", "rope_scaling", "quantization_config"):
        if hf.get(field) is not None and not isinstance(hf[field], dict):
            raise invalid(field, hf[field], "an object of settings")
    rope = hf.get("rope_parameters")
    fields = {**hf, **({"rope_theta": rope["rope_theta"]} if rope and "rope_theta" in rope else {})}
    for field, accepted in FIELDS.items():
        if fields.get(field) is not None and not accepted.admits(fields[field]):
            raise invalid(field, fields[field], accepted.describe())
    _check_head_dim(hf)
    _check_eos(hf.get("eos_token_id"))
    check_dtype(hf)


def _check_head_dim(hf: dict) -> None:
    """Without ``head_dim`` transformers takes ``hidden_size // num_attention_heads``; a
    remainder would leave part of the hidden state out of every head."""
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    if hf.get("head_dim") is None and hidden % heads:
        raise ValueError(f"config field num_attention_heads={heads} does not divide "
                         f"hidden_size={hidden}: expected a divisor of it (or a head_dim field)")


def _check_eos(eos) -> None:
    ids = eos if isinstance(eos, list) else [eos]
    if eos is not None and not all(COUNT.admits(i) for i in ids):
        raise invalid("eos_token_id", eos, "a token id (an integer >= 0) or a list of them")


def check_dtype(hf: dict) -> str | None:
    """The dtype the checkpoint's config names (None: none named), refused unless the
    engine computes in it: an FP8 name would load and fail at the first step."""
    for field in DTYPE_FIELDS:
        value = hf.get(field)
        if value is not None and value not in RUNNABLE_DTYPES:
            fp8 = " (FP8 checkpoints are not supported)" if "float8" in str(value) else ""
            raise invalid(field, value, f"one of {', '.join(RUNNABLE_DTYPES)}{fp8}")
    return next((hf[f] for f in DTYPE_FIELDS if hf.get(f) is not None), None)
