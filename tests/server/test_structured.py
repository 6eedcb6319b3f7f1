"""Structured outputs on llama-server: `response_format` through the real `openai` client, every reply validated with
`jsonschema`, and the engine's promise kept under a constraint: a constrained choice in a batch beside unconstrained
ones gets exactly `Llama.generate`'s tokens alone, with the KV cache or without it. A bad schema is a 400 in OpenAI's
error shape, and a server without llguidance says what to install.

The tiny random model says nothing the grammar does not force, so its schemas are finite (every string, array and
number bounded) and only what the grammar guarantees is checked; the real default model shows that a reply is the
JSON an application asked for, and that the client's `parse` works end to end."""

import builtins
import json
import sys
from typing import List, Literal

import httpx
import pytest

openai = pytest.importorskip("openai")
import jsonschema  # noqa: E402  (the test extra has it, pydantic and llguidance)
import pydantic  # noqa: E402

from helpers import FINITE_SCHEMAS, KEY, Server, build, make_engine, run_jobs  # noqa: E402
from llama import Grammar  # noqa: E402
from llama.sampling import SamplingControls  # noqa: E402
from llama.server.engine import Job  # noqa: E402

MAX_SEQ_LEN = 512
# tests/helpers.py's finite schemas: whatever the tiny model picks, the reply ends within max_tokens.
TINY_SCHEMAS = {name: FINITE_SCHEMAS[name] for name in ("nested", "enum", "array")}


@pytest.fixture(scope="module")
def llama(nonstop_ckpt):
    return build(nonstop_ckpt, max_seq_len=MAX_SEQ_LEN)


def encode(llama, text):
    return llama.tokenizer.encode(text, bos=True, eos=False)


def as_format(schema, name="reply"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.mark.parametrize("settings", [dict(), dict(kv_cache=False), dict(num_blocks=256, block_size=1, prefill_chunk=3),
                                      dict(speculate="ngram")],
                         ids=["cache", "no-cache", "tiny-blocks", "speculating-server"])
def test_constrained_and_free_rows_in_one_batch_equal_generate_alone(llama, settings):
    """Every constrained choice beside a free one and a controlled one, in one batch: each gets `Llama.generate`'s
    tokens alone and uncached. On a server that speculates, the free rows draft and the constrained ones do not."""
    engine = make_engine(llama, parallel=8, **{"num_blocks": 256, **settings})
    texts = ["the the the the cat", "Once upon a time", "A B C A B C A B"]
    controls = SamplingControls(frequency_penalty=0.8, top_k=30)
    jobs, expected = [], []
    for text, name in zip(texts, TINY_SCHEMAS):
        prompt = encode(llama, text)
        grammar = Grammar.json_schema(TINY_SCHEMAS[name])
        for kind in [dict(), dict(grammar=grammar), dict(grammar=grammar, controls=controls)]:
            jobs.append(Job(prompt, 120, None, temperature=0, **kind))
            expected.append(llama.generate([prompt], 120, temperature=0, kv_cache=False, **kind)[0][0])
    collectors = run_jobs(engine, jobs)
    for job, c, tokens in zip(jobs, collectors, expected):
        assert c.texts() == [llama.tokenizer.decode(tokens)]
        if job.grammar is not None:
            assert c.finish_reasons() == ["stop"]
            json.loads(c.texts()[0])
    engine.drain(5)


def test_seeded_sampling_under_a_schema_is_the_same_in_a_crowd_and_alone(llama):
    prompt = encode(llama, "the the the the cat")
    grammar = Grammar.json_schema(TINY_SCHEMAS["nested"])
    job = lambda: Job(prompt, 120, None, temperature=0.9, top_p=0.95, seed=11, grammar=grammar)  # noqa: E731
    alone = run_jobs(make_engine(llama, num_blocks=128), [job()])[0].texts()
    crowd = run_jobs(make_engine(llama, num_blocks=128, kv_cache=False),
                     [Job(encode(llama, "x y z"), 16, None, seed=3), job(), Job(prompt, 16, None, temperature=0)])
    assert alone == crowd[1].texts()
    jsonschema.validate(json.loads(alone[0]), TINY_SCHEMAS["nested"])


def test_max_tokens_cuts_a_constrained_reply_with_length(llama):
    engine = make_engine(llama, num_blocks=128)
    job = Job(encode(llama, "Hi"), 3, None, temperature=0, grammar=Grammar.json_schema(TINY_SCHEMAS["nested"]))
    assert run_jobs(engine, [job])[0].finish_reasons() == ["length"]
    engine.drain(5)


@pytest.fixture(scope="module")
def server(nonstop_ckpt):
    s = Server(nonstop_ckpt, "--api-key", KEY, "--parallel", "4", "--block-size", "4", max_seq_len=MAX_SEQ_LEN)
    yield s
    assert s.stop() == 0, "\n".join(s.lines[-20:])


@pytest.mark.parametrize("name", list(TINY_SCHEMAS))
def test_every_reply_validates_streamed_or_not_and_equals_generate(server, llama, name):
    client = server.client()
    messages = [{"role": "user", "content": "Reply in JSON."}]
    prompt = llama.dialog_tokens(messages)
    grammar = Grammar.json_schema(TINY_SCHEMAS[name])
    expected = llama.tokenizer.decode(llama.generate([prompt], 200, temperature=0, grammar=grammar)[0][0])
    reply = client.chat.completions.create(model="m", messages=messages, max_tokens=200, temperature=0,
                                           response_format=as_format(TINY_SCHEMAS[name]))
    assert reply.choices[0].message.content == expected and reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(expected), TINY_SCHEMAS[name])
    stream = client.chat.completions.create(model="m", messages=messages, max_tokens=200, temperature=0, stream=True,
                                            response_format=as_format(TINY_SCHEMAS[name]))
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    # Sampled, several choices: each validates.
    sampled = client.chat.completions.create(model="m", messages=messages, max_tokens=200, temperature=1.0, n=3,
                                             seed=7, response_format=as_format(TINY_SCHEMAS[name]))
    for choice in sampled.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), TINY_SCHEMAS[name])


def test_json_object_and_completions(server, llama):
    client = server.client()
    # Any object: the tiny model may nest without end, so the check is the one the grammar makes at every length:
    # a stop ends a complete object.
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "JSON please"}],
                                           max_tokens=60, temperature=0, response_format={"type": "json_object"})
    text, reason = reply.choices[0].message.content, reply.choices[0].finish_reason
    assert text.lstrip().startswith("{")
    if reason == "stop":
        assert isinstance(json.loads(text), dict)
    plain = client.completions.create(model="m", prompt="Hello", max_tokens=200, temperature=0,
                                      extra_body={"response_format": as_format(TINY_SCHEMAS["enum"])})
    expected = llama.generate([encode(llama, "Hello")], 200, temperature=0,
                              grammar=Grammar.json_schema(TINY_SCHEMAS["enum"]))[0][0]
    assert plain.choices[0].text == llama.tokenizer.decode(expected)
    jsonschema.validate(json.loads(plain.choices[0].text), TINY_SCHEMAS["enum"])
    text_format = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                                 temperature=0, response_format={"type": "text"})
    free = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                          temperature=0)
    assert text_format.choices[0].message.content == free.choices[0].message.content


class Answer(pydantic.BaseModel):
    answer: Literal["yes", "no", "unsure"]
    score: Literal[1, 2, 3]


def test_the_responses_api_takes_text_format(server, llama):
    """`client.responses.parse(text_format=Model)` sends the schema as `text.format`; the reply is the chat one."""
    client = server.client()
    parsed = client.responses.parse(model="m", input="Answer in JSON.", text_format=Answer, max_output_tokens=200,
                                    temperature=0)
    assert isinstance(parsed.output_parsed, Answer) and parsed.status == "completed"
    chat = client.chat.completions.parse(model="m", messages=[{"role": "user", "content": "Answer in JSON."}],
                                         response_format=Answer, max_tokens=200, temperature=0)
    assert parsed.output_text == chat.choices[0].message.content
    r = httpx.post(server.url + "/v1/responses", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                            "schema": {"type": "nonsense"}}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format", r.text


def test_langchain_with_structured_output(server):
    import langchain_openai
    llm = langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key=KEY, model="m", temperature=0,
                                      max_tokens=200, max_retries=0)
    for method in ("json_schema", "json_mode"):
        if method == "json_mode":  # the schema is only in the prompt: any object comes back, as a dict
            out = llm.with_structured_output(None, method=method).invoke("Answer in JSON.")
            assert isinstance(out, dict)
        else:
            assert isinstance(llm.with_structured_output(Answer, method=method).invoke("Answer in JSON."), Answer)


@pytest.mark.parametrize("response_format, param, code, reason", [
    (as_format({"type": "nonsense"}), "response_format", "invalid_json_schema", "nonsense"),
    (as_format({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}), "response_format",
     "invalid_json_schema", "nowhere"),
    (as_format({"type": "string", "pattern": "(("}), "response_format", "invalid_json_schema", "regex"),
    ({"type": "json_schema"}, "response_format.json_schema", "invalid_type", "json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "response_format.json_schema.schema",
     "invalid_type", "schema"),
    ({"type": "xml"}, "response_format.type", "invalid_value", "xml"),
    ("json", "response_format", "invalid_type", "object"),
])
def test_bad_formats_are_openai_shaped_400s(server, response_format, param, code, reason):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                       ("/v1/completions", {"prompt": "Hi"})):
        r = httpx.post(server.url + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                       content=json.dumps({**body, "max_tokens": 2, "response_format": response_format}))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code), error
        assert reason in error["message"]
    with pytest.raises(openai.BadRequestError):
        server.client().chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=2, response_format=response_format)
    assert server.proc.poll() is None


def test_without_llguidance_a_request_for_json_gets_a_400_that_says_what_to_install(llama, monkeypatch):
    """In process (the import made to fail here): a 400 naming the extra, never a 500; free text still served."""
    from starlette.testclient import TestClient

    from llama.server.app import create_server_app

    real_import = builtins.__import__

    def no_llguidance(name, *args, **kwargs):
        if name == "llguidance":
            raise ImportError("No module named 'llguidance'")
        return real_import(name, *args, **kwargs)

    engine = make_engine(llama)
    app, _ = create_server_app(engine, model_id="m")
    monkeypatch.delitem(sys.modules, "llguidance")
    monkeypatch.setattr(builtins, "__import__", no_llguidance)
    with TestClient(app) as client:
        for response_format in ({"type": "json_object"}, as_format(TINY_SCHEMAS["enum"])):
            r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                          "max_tokens": 2, "response_format": response_format})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "structured_outputs_unavailable" and error["param"] == "response_format"
            assert 'pip install "llama-kv[structured]"' in error["message"]
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert r.status_code == 200
    engine.drain(5)


# The real default model: what an application sees.

class Fruit(pydantic.BaseModel):
    name: str
    color: Literal["red", "yellow", "green", "orange"]


class Basket(pydantic.BaseModel):
    owner: str
    fruits: List[Fruit]


REAL_SCHEMAS = {
    "nested": ("Describe New York as JSON.",
               {"type": "object", "additionalProperties": False, "required": ["city", "country"],
                "properties": {"city": {"type": "object", "additionalProperties": False,
                                        "required": ["name", "population"],
                                        "properties": {"name": {"type": "string"},
                                                       # Bounded: unbounded, the greedy model repeats a digit
                                                       # until max_tokens ("81111...").
                                                       "population": {"type": "integer", "minimum": 0,
                                                                      "maximum": 100_000_000}}},
                               "country": {"type": "string"}}}),
    "enum and number": ("Is the sky blue? Answer as JSON.",
                        {"type": "object", "additionalProperties": False, "required": ["answer", "confidence"],
                         "properties": {"answer": {"enum": ["yes", "no", "unsure"]},
                                        "confidence": {"type": "number", "minimum": 0, "maximum": 1}}}),
    "array": ("List three fruits as JSON.",
              {"type": "object", "additionalProperties": False, "required": ["fruits"],
               "properties": {"fruits": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                                         "maxItems": 5}}}),
    "numbers": ("Give the temperature in Paris as JSON.",
                {"type": "object", "additionalProperties": False, "required": ["celsius", "readings"],
                 "properties": {"celsius": {"type": "number"},
                                "readings": {"type": "array", "items": {"type": "integer"}, "maxItems": 4}}}),
}


@pytest.fixture(scope="module")
def real_server():
    from llama.convert.fetch import default_model_dir

    s = Server(default_model_dir(), "--api-key", KEY, "--parallel", "4", max_seq_len=1024)
    yield s
    assert s.stop() == 0, "\n".join(s.lines[-20:])


@pytest.fixture(scope="module")
def real_llama():
    from llama import Llama
    from llama.convert.fetch import default_model_dir

    return Llama.build(default_model_dir(), max_seq_len=1024, max_batch_size=4, device="cpu", dtype="float32",
                       compile=False)


@pytest.mark.slow  # the real default model
def test_the_default_model_replies_with_valid_json_for_every_schema(real_server, real_llama):
    """Greedy and sampled, each reply validates and ends with "stop"; the greedy one is `Llama.generate`'s without
    the KV cache, token for token."""
    client = real_server.client()
    for name, (question, schema) in REAL_SCHEMAS.items():
        messages = [{"role": "user", "content": question}]
        reply = client.chat.completions.create(model="m", messages=messages, max_tokens=200, temperature=0,
                                               response_format=as_format(schema))
        text = reply.choices[0].message.content
        assert reply.choices[0].finish_reason == "stop", (name, text)
        jsonschema.validate(json.loads(text), schema)
        (tokens,), _ = real_llama.generate([real_llama.dialog_tokens(messages)], 200, temperature=0, kv_cache=False,
                                           grammar=Grammar.json_schema(schema))
        assert text == real_llama.tokenizer.decode(tokens), name
        sampled = client.chat.completions.create(model="m", messages=messages, max_tokens=300, temperature=0.7,
                                                 seed=3, n=2, response_format=as_format(schema))
        for choice in sampled.choices:
            if choice.finish_reason == "stop":  # a sampled number may run to max_tokens; a stop is complete
                jsonschema.validate(json.loads(choice.message.content), schema)


@pytest.mark.slow  # the real default model
def test_the_openai_clients_parse_with_a_pydantic_model(real_server):
    client = real_server.client()
    completion = client.chat.completions.parse(
        model="m", messages=[{"role": "user", "content": "Fill a basket for Ann with two fruits, as JSON."}],
        response_format=Basket, max_tokens=300, temperature=0)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Basket) and message.parsed.fruits
    # json_object: any object. (A 135M model asked for open-ended JSON often nests without end until max_tokens; a
    # schema bounds it. This question it answers in a few keys.)
    reply = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "What is the capital of France? Reply with a JSON object."}],
        response_format={"type": "json_object"}, max_tokens=200, temperature=0)
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
