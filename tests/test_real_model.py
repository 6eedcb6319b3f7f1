"""A real model: SmolLM2-135M-Instruct, fetched with llama-download and converted from its Q4_1 GGUF file,
against transformers loading the same GGUF file. Only a real model can show that the tokenizer is exact,
that the text is coherent, and that another implementation agrees with ours.

The first run downloads about 93 MB into $LLAMA_HOME; later runs reuse it.
"""

import pytest
import torch

from llama import Llama
from llama.dialog import encode_dialog
from llama.convert.fetch import default_model_dir, default_model_gguf

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers needs it to load a GGUF file

pytestmark = pytest.mark.slow

torch.set_num_threads(2)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a village of 1,024 people,",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]

TEXTS = [
    "Hello world",
    "naïve café — 日本語のテキスト, Ünïcödé and emoji 🤖🎉",
    "1234567890 3.14159 1,000,000 x2 v1.2.3",
    "  leading spaces,\n\n\nthree newlines,\ttabs\t\tand   runs of   spaces   ",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(12), {'a': [1, 2]})\n",
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
    "<|endoftext|>text after the end<repo_name>",
    "don't, I'll, we've, they're",
    "a\r\nwindows line\r\n",
    "   ",
]


@pytest.fixture(scope="session")
def ckpt_dir():
    return default_model_dir()


@pytest.fixture(scope="session")
def llama(ckpt_dir) -> Llama:
    return Llama.build(ckpt_dir, max_seq_len=256, max_batch_size=4, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def hf_model(ckpt_dir):
    path = default_model_gguf()
    model = transformers.LlamaForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(ckpt_dir):
    path = default_model_gguf()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_transformers(llama, hf_model, prompt):
    ids = torch.tensor([llama.tokenizer.encode(prompt, bos=True, eos=False)])
    with torch.no_grad():
        ours = llama.model(ids)
        theirs = hf_model(ids).logits.float()
    # Measured within 7e-5 on logits of magnitude ~40 (30 layers, transformers' own kernels and order of
    # additions); 1e-3 leaves room for other versions of both. A wrong rotary layout or norm is off by more than 1.
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-3)


STORY = "Once upon a time, there was a little robot who"


@pytest.fixture(scope="session")
def hf_continuation(llama, hf_model):
    """transformers' greedy continuation of STORY, up to 64 tokens, without the stop token it ended on."""
    prompt = llama.tokenizer.encode(STORY, bos=True, eos=False)
    stop_ids = llama.tokenizer.stop_ids
    out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False,
                            eos_token_id=stop_ids, pad_token_id=stop_ids[0])[0, len(prompt):].tolist()
    return out[:-1] if out and out[-1] in stop_ids else out


@pytest.mark.parametrize("kv_cache", [True, False], ids=["cache", "no-cache"])
def test_greedy_continuation_matches_transformers(llama, hf_continuation, kv_cache):
    prompt = llama.tokenizer.encode(STORY, bos=True, eos=False)
    ours, _ = llama.generate([prompt], max_gen_len=64, temperature=0, kv_cache=kv_cache)
    assert len(ours[0]) > 8
    assert ours[0] == hf_continuation


def test_tokenizer_ids_match_transformers(llama, hf_tokenizer):
    for text in TEXTS:
        ours = llama.tokenizer.encode(text, bos=True, eos=False)  # SmolLM2 adds no bos
        assert ours == hf_tokenizer(text)["input_ids"], text
        assert llama.tokenizer.decode(ours) == hf_tokenizer.decode(ours, skip_special_tokens=True)
    assert llama.tokenizer.encode("<|im_start|>", bos=False, eos=False) == [llama.tokenizer.token_to_id("<|im_start|>")]


@pytest.mark.parametrize("dialog", [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Colour of the sky?"}],
], ids=["default-system", "own-system"])
def test_chat_prompt_matches_the_models_template(llama, hf_tokenizer, dialog):
    theirs = hf_tokenizer.apply_chat_template(dialog, add_generation_prompt=True, tokenize=True)
    theirs = theirs["input_ids"] if hasattr(theirs, "keys") else theirs
    assert encode_dialog(llama.tokenizer, dialog) == list(theirs)


def test_text_completion_knows_paris(llama):
    out = llama.text_completion(["The capital of France is"], temperature=0, max_gen_len=16)
    assert "Paris" in out[0]["generation"]


def test_chat_reply_stops_at_end_of_turn(llama):
    dialog = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = encode_dialog(llama.tokenizer, dialog)
    max_gen_len = 96
    reply, _ = llama.generate([prompt], max_gen_len=max_gen_len, temperature=0)
    im_end = llama.tokenizer.token_to_id("<|im_end|>")
    assert im_end in llama.tokenizer.stop_ids
    assert 0 < len(reply[0]) < max_gen_len  # it stopped by itself, before the limit
    text = llama.tokenizer.decode(reply[0])
    assert "Paris" in text and "<|im_end|>" not in text and im_end not in reply[0]

    predictions = llama.chat_completion([dialog], temperature=0, max_gen_len=max_gen_len)
    content = predictions[0]["generation"]["content"]
    assert content.strip() and "<|im_end|>" not in content and "<|im_start|>" not in content
