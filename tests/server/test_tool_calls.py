"""Tool calls on llama-server through the real `openai` client: `tools` with `tool_choice` "required", a named
function, "auto" and "none", `parallel_tool_calls`, replies in OpenAI's shape (`message.tool_calls`, finish reason
"tool_calls", streamed as `delta.tool_calls`), and a history with the assistant's calls and `role: "tool"` results.

Every call is generated under a grammar of the tools' schemas, so its arguments validate whatever the model; the tiny
random model's schemas are finite so that its calls end, and only what the grammar guarantees is checked."""

import json

import httpx
import pytest

openai = pytest.importorskip("openai")
import jsonschema  # noqa: E402  (the test extra has it, and llguidance)

from helpers import KEY, Server  # noqa: E402

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 8}}}
ADD = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                      "b": {"type": "integer", "minimum": 0, "maximum": 9}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(nonstop_ckpt):
    s = Server(nonstop_ckpt, "--api-key", KEY, "--parallel", "4", max_seq_len=1024)
    yield s
    assert s.stop() == 0, "\n".join(s.lines[-20:])


def ask(server, messages=QUESTION, **kwargs):
    kwargs = {"max_tokens": 300, "temperature": 0, **kwargs}
    return server.client().chat.completions.create(model="m", messages=messages, tools=TOOLS, **kwargs)


def check_calls(calls, names=tuple(SCHEMAS)):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_and_named_calls_validate(server, parallel):
    reply = ask(server, tool_choice="required", parallel_tool_calls=parallel)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls(choice.message.tool_calls)
    if not parallel:
        assert len(choice.message.tool_calls) == 1
    named = ask(server, tool_choice={"type": "function", "function": {"name": "add"}}, parallel_tool_calls=parallel)
    check_calls(named.choices[0].message.tool_calls, names=("add",))
    sampled = ask(server, tool_choice="required", temperature=1.0, seed=5, n=3)
    for c in sampled.choices:
        check_calls(c.message.tool_calls)


def test_streamed_calls_are_the_whole_calls(server):
    whole = ask(server, tool_choice="required").choices[0].message.tool_calls
    chunks = list(ask(server, tool_choice="required", stream=True))
    streamed = [call for c in chunks if c.choices and c.choices[0].delta.tool_calls for call in c.choices[0].delta.tool_calls]
    assert [(c.function.name, c.function.arguments) for c in streamed] == \
           [(c.function.name, c.function.arguments) for c in whole]
    assert [c.index for c in streamed] == list(range(len(whole)))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_is_a_call_or_text_and_none_is_the_plain_reply(server):
    reply = ask(server, tool_choice="auto").choices[0]
    if reply.message.tool_calls:
        check_calls(reply.message.tool_calls)
    else:
        assert not reply.message.content.startswith("<tool_call>")
    plain = server.client().chat.completions.create(model="m", messages=QUESTION, max_tokens=12, temperature=0)
    none = ask(server, tool_choice="none", max_tokens=12)
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.choices[0].message.tool_calls is None


def test_a_history_with_calls_and_their_results(server):
    """The agent loop: a call, the tool's result, the answer."""
    first = ask(server, tool_choice="required", parallel_tool_calls=False).choices[0].message
    history = QUESTION + [first.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"} for call in first.tool_calls]
    answer = ask(server, messages=history, tool_choice="none", max_tokens=16).choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    again = ask(server, messages=history, tool_choice="required").choices[0]
    check_calls(again.message.tool_calls)


def test_langchain_bind_tools(server):
    import langchain_openai
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def add(a: int, b: int) -> int:
        """Add a and b."""
        return a + b

    llm = langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key=KEY, model="m", temperature=0,
                                      max_tokens=300, max_retries=0)
    message = llm.bind_tools([add], tool_choice="required").invoke("What is 2 + 3?")
    assert message.tool_calls and {c["name"] for c in message.tool_calls} == {"add"}
    for call in message.tool_calls:
        jsonschema.validate(call["args"], add.tool_call_schema.model_json_schema())
    # The loop's second step: the calls' results go back as ToolMessages; the reply is words or calls again.
    results = [ToolMessage(content="5", tool_call_id=c["id"]) for c in message.tool_calls]
    answer = llm.bind_tools([add]).invoke([HumanMessage("What is 2 + 3?"), message, *results])
    assert answer.content or answer.tool_calls


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]}, "tools"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": [{"function": {}}]},
                   {"role": "tool", "content": "x"}]}, "messages"),
])
def test_bad_tools_are_openai_shaped_400s(server, body, param):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **body}
    r = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json=body)
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"} and r.json()["error"]["param"] == param


@pytest.mark.slow  # the real default model
def test_the_default_model_runs_a_two_step_agent_loop():
    from llama.convert.fetch import default_model_dir

    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                               "parameters": {"type": "object", "additionalProperties": False,
                                                              "required": ["city"],
                                                              "properties": {"city": {"type": "string"}}}}}]
    s = Server(default_model_dir(), "--api-key", KEY, max_seq_len=2048)
    try:
        client = s.client()
        first = client.chat.completions.create(model="m", messages=QUESTION, tools=tools, tool_choice="required",
                                               parallel_tool_calls=False, max_tokens=100, temperature=0).choices[0]
        assert first.finish_reason == "tool_calls"
        (call,) = first.message.tool_calls
        assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
        history = QUESTION + [first.message.model_dump(exclude_none=True),
                              {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
        answer = client.chat.completions.create(model="m", messages=history, tools=tools, tool_choice="none",
                                                max_tokens=60, temperature=0).choices[0]
        assert answer.message.tool_calls is None and answer.message.content
    finally:
        assert s.stop() == 0
