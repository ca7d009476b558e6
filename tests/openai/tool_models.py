"""The tiny text model with a chat template in the Hermes style (Qwen2.5/Qwen3's tool
calls in ``<tool_call>`` tags, Qwen3's ``enable_thinking`` switch) written into its
tokenizer config: a served model that takes tools and thinks in ``<think>``. Not a test
module."""

import functools
import json
import shutil

from hf_models import new_tmpdir
from text_models import text_model_dir

HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
# Tools

You may call one or more functions to assist with the user query.

<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == "assistant" %}<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""


@functools.lru_cache(maxsize=None)
def hermes_model_dir():
    """A copy of ``text_model_dir`` whose chat template is ``HERMES_TEMPLATE``."""
    source, path = text_model_dir(), new_tmpdir("ts_hermes_llama_")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        shutil.copy(source / name, path / name)
    config = json.loads((source / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": HERMES_TEMPLATE}))
    return path
