"""The sampling controls on llama-server: penalties, logit_bias, top_k, min_p and the repeat penalty, per row of the
batched step. A choice under them gets exactly `Llama.generate`'s tokens alone under the same controls, beside
choices without them, through the KV cache or without it and with drafts; through the real `openai` client the
text changes as each control says; a bad value is a 400 in OpenAI's error shape."""

import json

import httpx
import pytest

openai = pytest.importorskip("openai")

from helpers import KEY, Always, Server, build, make_engine, run_jobs  # noqa: E402
from llama.sampling import SamplingControls  # noqa: E402
from llama.server.engine import Job  # noqa: E402

MAX_SEQ_LEN = 128
EVERY_CONTROL = SamplingControls(frequency_penalty=0.8, presence_penalty=0.5, repeat_penalty=1.4, repeat_last_n=24,
                                 logit_bias=((13, 3.0), (42, -100.0)), top_k=30, min_p=0.05)
EACH_CONTROL = [SamplingControls(frequency_penalty=2.0), SamplingControls(presence_penalty=2.0),
                SamplingControls(repeat_penalty=2.0, repeat_last_n=-1), SamplingControls(logit_bias=((9, 8.0),)),
                EVERY_CONTROL]


@pytest.fixture(scope="module")
def llama(nonstop_ckpt):
    return build(nonstop_ckpt, max_seq_len=MAX_SEQ_LEN)


def encode(llama, text):
    return llama.tokenizer.encode(text, bos=True, eos=False)


@pytest.mark.parametrize("settings", [dict(), dict(kv_cache=False), dict(num_blocks=256, block_size=1, prefill_chunk=3),
                                      dict(speculate=Always(), draft_tokens=3)],
                         ids=["cache", "no-cache", "tiny-blocks", "drafts"])
def test_rows_with_and_without_controls_in_one_batch_equal_generate_alone(llama, settings):
    engine = make_engine(llama, parallel=8, **settings)
    texts = ["the the the the cat", "Once upon a time", "A B C A B C A B", "def f(x): return x"]
    jobs, expected = [], []
    for i, text in enumerate(texts):
        prompt = encode(llama, text)
        for controls in [None] + EACH_CONTROL[i % 2 :: 2]:  # a plain row beside every controlled one
            jobs.append(Job(prompt, 20, None, temperature=0, controls=controls))
            expected.append(llama.generate([prompt], 20, temperature=0, kv_cache=False, controls=controls)[0][0])
    collectors = run_jobs(engine, jobs)
    for c, tokens in zip(collectors, expected):
        assert c.texts() == [llama.tokenizer.decode(tokens)]
    engine.drain(5)


def test_seeded_sampling_under_every_control_is_the_same_in_a_crowd_and_alone(llama):
    prompt = encode(llama, "the the the the cat")
    job = lambda: Job(prompt, 16, None, temperature=0.9, top_p=0.95, seed=11, controls=EVERY_CONTROL)  # noqa: E731
    alone = run_jobs(make_engine(llama), [job()])[0].texts()
    crowd = run_jobs(make_engine(llama, kv_cache=False), [Job(encode(llama, "x y z"), 16, None, seed=3), job(),
                                                         Job(prompt, 16, None, temperature=0)])[1].texts()
    assert alone == crowd


@pytest.fixture(scope="module")
def server(nonstop_ckpt):
    s = Server(nonstop_ckpt, "--api-key", KEY, "--parallel", "4", "--block-size", "4", max_seq_len=MAX_SEQ_LEN)
    yield s
    assert s.stop() == 0, "\n".join(s.lines[-20:])


def chat(server, **extra):
    reply = server.client().chat.completions.create(
        model="any", messages=[{"role": "user", "content": "the the the the cat sat on the"}], max_tokens=24,
        temperature=0, **extra)
    return reply.choices[0].message.content


def test_each_control_changes_the_text_as_generate_does(server, llama):
    prompt = llama.dialog_tokens([{"role": "user", "content": "the the the the cat sat on the"}])
    plain = chat(server)
    assert plain == llama.tokenizer.decode(llama.generate([prompt], 24, temperature=0)[0][0])
    bodies = {"frequency_penalty": 2.0, "presence_penalty": 2.0, "logit_bias": {"9": 8.0}}
    controls = {"frequency_penalty": SamplingControls(frequency_penalty=2.0),
                "presence_penalty": SamplingControls(presence_penalty=2.0),
                "logit_bias": SamplingControls(logit_bias=((9, 8.0),))}
    for name, value in bodies.items():
        text = chat(server, **{name: value})
        expected, _ = llama.generate([prompt], 24, temperature=0, kv_cache=False, controls=controls[name])
        assert text == llama.tokenizer.decode(expected[0]), name
        assert text != plain, f"{name} changed nothing"
    # Controls of vLLM and llama.cpp, through the client's extra_body; every one at once, cached and not.
    extra = {"top_k": 30, "min_p": 0.05, "repeat_penalty": 1.4, "repeat_last_n": 24}
    every = dict(frequency_penalty=0.8, presence_penalty=0.5, logit_bias={"13": 3, "42": -100})
    expected, _ = llama.generate([prompt], 24, temperature=0, kv_cache=False, controls=EVERY_CONTROL)
    assert chat(server, **every, extra_body=extra) == llama.tokenizer.decode(expected[0])
    assert chat(server, **every, extra_body={**extra, "cache_prompt": False}) == llama.tokenizer.decode(expected[0])


def test_a_bias_of_100_makes_the_token_every_token(server, llama):
    token = 50
    reply = server.client().completions.create(model="any", prompt="Hello", max_tokens=6, temperature=0,
                                               logit_bias={str(token): 100})
    assert reply.choices[0].text == llama.tokenizer.decode([token] * 6)
    stream = server.client().completions.create(model="any", prompt="Hello", max_tokens=6, temperature=0,
                                                logit_bias={str(token): 100}, stream=True)
    assert "".join(c.choices[0].text for c in stream) == reply.choices[0].text


@pytest.mark.parametrize("field, value, param, code", [
    ("presence_penalty", 3, "presence_penalty", "invalid_value"),
    ("frequency_penalty", "high", "frequency_penalty", "invalid_type"),
    ("logit_bias", {"abc": 1}, "logit_bias", "invalid_value"),
    ("logit_bias", {"99999999": 1}, "logit_bias", "invalid_value"),
    ("logit_bias", {"5": 101}, "logit_bias.5", "invalid_value"),
    ("logit_bias", [1, 2], "logit_bias", "invalid_type"),
    ("top_k", -2, "top_k", "invalid_value"),
    ("min_p", 1.5, "min_p", "invalid_value"),
    ("repeat_penalty", 0, "repeat_penalty", "invalid_value"),
])
def test_bad_values_are_openai_shaped_400s(server, field, value, param, code):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                       ("/v1/completions", {"prompt": "Hi"})):
        r = httpx.post(server.url + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                       content=json.dumps({**body, "max_tokens": 2, field: value}))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code), error
    with pytest.raises(openai.BadRequestError):
        chat(server, **{field: value}) if field in ("presence_penalty", "frequency_penalty", "logit_bias") else \
            chat(server, extra_body={field: value})
