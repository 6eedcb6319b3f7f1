"""The model's own chat template (llama/chat_template.py): rendered as transformers' `apply_chat_template` renders it,
its special tokens read as a tokenizer.json reads them, and tools recognised only where the template reads them.

The server's use of it, a request's messages and tools through a tiny model's Qwen2.5 template, is in
tests/server/test_tool_calls.py."""

import builtins
import sys

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from helpers import EXAMPLE_TOKENIZER, QWEN25_TEMPLATE, write_template_model
from llama import chat_template
from llama.dialog import encode_dialog_llama2
from llama.errors import LlamaError
from llama.tokenizer import Tokenizer

# SmolLM2-Instruct's template (the default model's): ChatML turns and a default system message, no tools.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + "
    "message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Le temps qu'il fait à une ville",
                                           "parameters": {"type": "object", "required": ["city"],
                                                          "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "add", "description": "a + b",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]
CALLS = {"role": "assistant", "content": "",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                          "arguments": {"city": "Zürich"}}},
                        {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": {"a": 2}}}]}
DIALOGS = {
    "a question": [{"role": "user", "content": "Weather in Zürich?"}],
    "a system message": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    "calls and their results": [{"role": "user", "content": "Weather in Zürich, and 2 + 0?"}, CALLS,
                                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
                                {"role": "tool", "tool_call_id": "call_2", "content": "2"}],
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer(str(write_template_model(tmp_path_factory.mktemp("ckpt") / "qwen", QWEN25_TEMPLATE)
                         / "tokenizer.json"))


@pytest.mark.parametrize("name", list(DIALOGS))
@pytest.mark.parametrize("tools", [TOOLS, None])
def test_a_dialog_renders_and_encodes_as_transformers_does(tokenizer, name, tools):
    ours = chat_template.render(QWEN25_TEMPLATE, DIALOGS[name], tools)
    (theirs,), _ = render_jinja_template([DIALOGS[name]], tools=tools, chat_template=QWEN25_TEMPLATE,
                                         add_generation_prompt=True)
    assert ours == theirs
    assert ("# Tools" in ours) == (tools is not None)
    assert ("à une ville" in ours) == (tools is not None)  # tojson keeps non-ASCII text, as transformers' does
    ids = chat_template.encode_rendered(tokenizer, ours)
    assert ids == tokenizer.hf_tokenizer.encode(theirs, add_special_tokens=False).ids
    assert ids.count(tokenizer.token_to_id("<|im_start|>")) == ours.count("<|im_start|>") > 0


def test_a_sentencepiece_template_writes_bos_as_its_id():
    tokenizer = Tokenizer(str(EXAMPLE_TOKENIZER))
    text = chat_template.render("{{ bos_token }}[INST] {{ messages[0]['content'] }} [/INST]",
                                [{"role": "user", "content": "Hi there"}], bos_token="<s>")
    assert chat_template.encode_rendered(tokenizer, text) == encode_dialog_llama2(
        tokenizer, [{"role": "user", "content": "Hi there"}])


@pytest.mark.parametrize("template, knows", [
    (QWEN25_TEMPLATE, True),
    (SMOLLM2_TEMPLATE, False),
    ("{{ 'no tools here' }}{% for m in messages %}{{ m.content }}{% endfor %}", False),  # the word, not the variable
    ("{% set tools = [] %}{{ tools }}", False),  # set by the template itself, not given to it
    ("{% if tools %}{{ tools | tojson }}", False),  # not valid Jinja: the Hermes form, not an error
    ("", False),
    (None, False),
])
def test_a_template_knows_tools_where_it_reads_them(template, knows):
    assert chat_template.knows_tools(template) is knows


def test_the_template_raises_the_reason_and_has_transformers_helpers():
    with pytest.raises(LlamaError, match="Conversation roles must alternate"):
        chat_template.render("{{ raise_exception('Conversation roles must alternate') }}", [])
    with pytest.raises(LlamaError, match="cannot render"):
        chat_template.render("{{ messages[0].content.upper() }}", [])
    text = chat_template.render("{% generation %}{{ messages | tojson(indent=1) }}{% endgeneration %}"
                                "{% for m in messages %}{% if m.role == 'x' %}{% break %}{% endif %}{% endfor %}"
                                "{{ strftime_now('%Y') | length }}", [{"role": "é"}])
    assert text == '[\n {\n  "role": "é"\n }\n]4'
    with pytest.raises(LlamaError, match="not valid Jinja"):
        chat_template.render("{% if %}", [])


def test_without_jinja2_only_a_template_that_names_tools_needs_it(monkeypatch):
    real_import = builtins.__import__

    def no_jinja2(name, *args, **kwargs):
        if name == "jinja2" or name.startswith("jinja2."):
            raise ImportError("No module named 'jinja2'")
        return real_import(name, *args, **kwargs)

    for name in [n for n in sys.modules if n == "jinja2" or n.startswith("jinja2.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(builtins, "__import__", no_jinja2)
    assert chat_template.knows_tools(SMOLLM2_TEMPLATE) is False  # no jinja2 needed to see it never names tools
    with pytest.raises(chat_template.TemplateUnavailable) as e:
        chat_template.knows_tools(QWEN25_TEMPLATE + "\n")  # another text than the one read (and cached) above
    assert str(e.value) == chat_template.INSTALL_HINT and 'pip install "llama-kv[server]"' in str(e.value)
