"""ChatTemplate renders a checkpoint's chat template exactly as transformers'
apply_chat_template(tokenize=False) does, for templates written the way real checkpoints
ship them (ChatML with tools and tojson, Llama 3 with trim and bos_token, Mistral with
raise_exception, Llama 3.2 with strftime_now)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bullet_trt.model.chat_template import ChatTemplate, ChatTemplateError
from bullet_trt.model.corpus_tokenizer import BOS, EOS, write_corpus_tokenizer

# Qwen2.5-Instruct's template (tool-call branches shortened; tojson and the default system
# prompt kept).
QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- for tool_call in message.tool_calls %}
            {{- '\\n<tool_call>\\n' }}{{- tool_call.function | tojson }}{{- '\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Meta-Llama-3-8B-Instruct's template, verbatim.
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
          "{{ content }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")

# Mistral-7B-Instruct-v0.1's template, verbatim.
MISTRAL = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
           "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
           "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
           "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
           "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
           "roles are supported!') }}{% endif %}{% endfor %}")

# The head of Llama-3.2-Instruct's template: the date from strftime_now, block trimming.
LLAMA32 = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

CHAT = [
    {"role": "system", "content": "  You answer briefly. <b>&'\"</b>  "},
    {"role": "user", "content": "Hi there — café?"},
    {"role": "assistant", "content": "Hello! 😀"},
    {"role": "user", "content": "What is 2+2?"},
]
ALTERNATING = CHAT[1:]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & here",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory) -> Path:
    return write_corpus_tokenizer(tmp_path_factory.mktemp("tok"))


def checkpoint_with(tmp_path: Path, tokenizer_files: Path, chat_template) -> Path:
    """A tokenizer directory whose tokenizer_config.json carries `chat_template`."""
    root = tmp_path / "ckpt"
    shutil.copytree(tokenizer_files, root)
    cfg = json.loads((root / "tokenizer_config.json").read_text())
    # eos_token in the AddedToken form many checkpoints write, bos_token as a plain string.
    eos = {"__type": "AddedToken", "content": EOS, "lstrip": False, "normalized": False, "rstrip": False,
           "single_word": False, "special": True}
    cfg.update(bos_token=BOS, eos_token=eos, chat_template=chat_template)
    (root / "tokenizer_config.json").write_text(json.dumps(cfg))
    return root


def transformers_render(root: Path, messages, add_generation_prompt: bool, **kwargs) -> str:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(root))
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)


@pytest.mark.parametrize("name, template, messages", [
    ("qwen2.5", QWEN25, CHAT),
    ("qwen2.5-no-system", QWEN25, ALTERNATING),
    ("llama3", LLAMA3, CHAT),
    ("mistral", MISTRAL, ALTERNATING),
    ("llama3.2", LLAMA32, CHAT),
])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_like_transformers(tmp_path, tokenizer_files, name, template, messages, add_generation_prompt):
    root = checkpoint_with(tmp_path, tokenizer_files, template)
    ours = ChatTemplate.from_tokenizer_dir(root).render(messages, add_generation_prompt=add_generation_prompt)
    assert ours == transformers_render(root, messages, add_generation_prompt)
    if template in (LLAMA3, MISTRAL, LLAMA32):
        assert ours.startswith(BOS)


def test_tools_and_none_fields_like_transformers(tmp_path, tokenizer_files):
    root = checkpoint_with(tmp_path, tokenizer_files, QWEN25)
    # OpenAI clients send content=None beside tool_calls; transformers drops None-valued keys.
    messages = ALTERNATING + [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]}]
    ours = ChatTemplate.from_tokenizer_dir(root).render(messages, tools=TOOLS)
    assert ours == transformers_render(root, messages, True, tools=TOOLS)
    assert '"description": "Weather <now> & here"' in ours  # tojson without HTML escaping


def test_named_templates_and_jinja_file(tmp_path, tokenizer_files):
    root = checkpoint_with(tmp_path, tokenizer_files, [{"name": "tool_use", "template": MISTRAL},
                                                       {"name": "default", "template": LLAMA3}])
    ours = ChatTemplate.from_tokenizer_dir(root).render(CHAT)
    assert ours == transformers_render(root, CHAT, True)
    assert "<|start_header_id|>" in ours
    # chat_template.jinja beside the config wins over the config's own
    (root / "chat_template.jinja").write_text(MISTRAL)
    ours = ChatTemplate.from_tokenizer_dir(root).render(ALTERNATING)
    assert ours == transformers_render(root, ALTERNATING, True)
    assert ours.startswith(BOS + "[INST] ")


def test_from_file_and_from_engine(tmp_path, tokenizer_files):
    file = tmp_path / "template.jinja"
    file.write_text(LLAMA3)
    assert ChatTemplate.from_file(file, {"bos_token": "<s>"}).render(CHAT[1:2]) == (
        "<s><|start_header_id|>user<|end_header_id|>\n\nHi there — café?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    root = checkpoint_with(tmp_path, tokenizer_files, MISTRAL)
    assert ChatTemplate.from_file(root / "tokenizer_config.json").render(ALTERNATING[:1]) == \
        f"{BOS}[INST] Hi there — café? [/INST]"
    # The embedded default engine's checkpoint ships no template; a file of one's own gets its
    # special tokens all the same.
    from tests.triton_fixture import ensure_tiny_random_engine
    assert ChatTemplate.from_engine(ensure_tiny_random_engine()) is None
    assert ChatTemplate.from_engine(ensure_tiny_random_engine(), file).render(CHAT[1:2]).startswith(
        BOS + "<|start_header_id|>user")


def test_engine_tokenizer_dir_is_found(tmp_path, tokenizer_files):
    root = checkpoint_with(tmp_path, tokenizer_files, LLAMA3)
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "engine.yaml").write_text(f"checkpoint: {root}\ntokenizer: {root / 'tokenizer.json'}\n")
    assert ChatTemplate.from_engine(engine).render(CHAT) == transformers_render(root, CHAT, True)


def test_template_errors_are_clear(tmp_path, tokenizer_files):
    root = checkpoint_with(tmp_path, tokenizer_files, MISTRAL)
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        ChatTemplate.from_tokenizer_dir(root).render(CHAT)
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate("{% for m in messages %}")
    # The sandbox keeps templates from reaching Python internals.
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}").render(CHAT)
