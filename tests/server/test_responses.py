"""`GET /v1/models/{id}` and the Responses API's text subset (`POST /v1/responses`) through the real `openai`
client's `models.retrieve` and `responses.create`, against a started server: the text equals the same
conversation's chat completion (greedy), whole and streamed as the typed events the client knows."""

import json

import httpx
import pytest

openai = pytest.importorskip("openai")

from helpers import KEY, Server  # noqa: E402

MAX_SEQ_LEN = 128


@pytest.fixture(scope="module")
def server(gqa_ckpt):
    s = Server(gqa_ckpt, "--api-key", KEY, "--parallel", "2", max_seq_len=MAX_SEQ_LEN)
    yield s
    assert s.stop() == 0, "\n".join(s.lines[-20:])


def test_models_retrieve_names_the_model_and_404s_an_unknown_one(server):
    client = server.client()
    listed = client.models.list().data
    model = client.models.retrieve(listed[0].id)
    assert (model.id, model.object, model.owned_by) == (listed[0].id, "model", "llama-kv")
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-nothing")
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"
    assert "gpt-nothing" in caught.value.body["message"]


def chat_text(server, messages, max_tokens):
    reply = server.client().chat.completions.create(model="any", messages=messages, max_tokens=max_tokens,
                                                    temperature=0)
    return reply.choices[0].message.content, reply.choices[0].finish_reason


@pytest.mark.parametrize("max_tokens", [6, 40])
def test_a_response_is_the_chat_completion_of_the_same_messages(server, max_tokens):
    client = server.client()
    response = client.responses.create(model="any", input="What is a list?", instructions="Be brief.",
                                       max_output_tokens=max_tokens, temperature=0)
    text, finish = chat_text(server, [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "What is a list?"}], max_tokens)
    assert response.output_text == text
    assert response.object == "response" and response.output[0].role == "assistant"
    assert response.status == ("incomplete" if finish == "length" else "completed")
    if finish == "length":
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens <= max_tokens and response.usage.input_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    # A list of messages, content as text parts, in the same conversation.
    listed = client.responses.create(model="any", input=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "What is a list?"}]}],
        max_output_tokens=max_tokens, temperature=0)
    assert listed.output_text == text


def test_a_streamed_response_sends_the_typed_events_in_order(server):
    client = server.client()
    whole = client.responses.create(model="any", input="Why is the sky blue?", max_output_tokens=12, temperature=0)
    events = list(client.responses.create(model="any", input="Why is the sky blue?", max_output_tokens=12,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * deltas + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1
    # The client's own accumulating helper reads the same stream into the same text.
    with client.responses.stream(model="any", input="Why is the sky blue?", max_output_tokens=12,
                                 temperature=0) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    assert text == whole.output_text


@pytest.mark.parametrize("body, param", [
    ({"input": 3}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "Hi", "temperature": 3}, "temperature"),
    ({"input": "Hi", "instructions": 5}, "instructions"),
])
def test_bad_responses_requests_are_openai_shaped_400s(server, body, param):
    r = httpx.post(server.url + "/v1/responses", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   content=json.dumps(body))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
