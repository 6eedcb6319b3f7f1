"""A chat whose KV cache outlives each reply: every reply equals a fresh run of the same dialog and the
uncached reply, while each turn feeds only the new tokens. Both chat formats: ChatML on the default model,
LLaMA-2's (which re-encodes earlier replies between </s><s>) on a random checkpoint with LLaMA-2's real
tokenizer. A conversation that outgrows the context drops its oldest exchanges, keeping the system prompt.
"""

from pathlib import Path

import pytest

from helpers import chat, chat_stats, write_tiny
from llama import Llama
from llama.convert.llama2_vocab import TOKENIZER_MODEL, fetch_llama2_vocab
from llama.chat.conversation import Conversation
from llama.errors import LlamaError
from llama.io.prompt_cache import PromptCacheError
MESSAGES = ["Hello! Who are you?", "What is the capital of France?", "And the capital of Italy?", "/reset",
            "Name three colours.", "Why is the sky blue?", "Thank you, goodbye."]


def llama2_tokenizer() -> Path:
    """LLaMA-2's real tokenizer; the first call in a fresh $LLAMA_HOME fetches it (see test_llama2_tokenizer.py)."""
    return fetch_llama2_vocab() / TOKENIZER_MODEL


@pytest.fixture(scope="module")
def llama2_ckpt(tmp_path_factory) -> Path:
    """A tiny random LLaMA-2 model with LLaMA-2's real 32,000-piece tokenizer (and so its chat format)."""
    path, _ = write_tiny(tmp_path_factory.mktemp("llama2") / "ckpt", seed=3, tokenizer=llama2_tokenizer(),
                         vocab_size=32000)
    return path


def converse(llama, messages, kv_cache=True, system=None, max_gen_len=16):
    """Run a scripted chat; returns (turn, reply) per message answered. Each turn answers the whole
    conversation so far: every earlier message and reply since the start or the last /reset."""
    chat = Conversation(llama, system, max_gen_len, kv_cache=kv_cache)
    start = [{"role": "system", "content": system}] if system else []
    so_far = list(start)
    out = []
    for text in messages:
        if text == "/reset":
            chat.reset()
            so_far = list(start)
            continue
        so_far.append({"role": "user", "content": text})
        turn = chat.prepare(text)
        assert turn.dropped == 0 and turn.dialog == so_far and turn.prompt == llama.dialog_tokens(so_far)
        reply = chat.respond(turn, temperature=0)
        so_far.append({"role": "assistant", "content": reply.text})
        out.append((turn, reply))
    return out


def check_replies_equal_fresh_and_uncached(llama, messages, system=None, max_gen_len=16):
    with_reuse = converse(llama, messages, True, system, max_gen_len)
    uncached = converse(llama, messages, False, system, max_gen_len)
    assert len(with_reuse) == len([m for m in messages if m != "/reset"]) >= 5
    for (turn, reply), (u_turn, u_reply) in zip(with_reuse, uncached):
        assert turn.prompt == u_turn.prompt and reply.tokens == u_reply.tokens and reply.text == u_reply.text
        # A fresh run: the same dialog's tokens through a call that holds nothing.
        (fresh,), _ = llama.generate([turn.prompt], turn.max_gen_len, temperature=0)
        assert reply.tokens == fresh
        assert reply.reused + reply.prefilled == len(turn.prompt)
        assert (u_reply.reused, u_reply.prefilled) == (0, len(turn.prompt))
    return with_reuse


def test_llama2_format_replies_equal_fresh_runs_and_feed_only_the_new_tokens(llama2_ckpt):
    llama = Llama.build(llama2_ckpt, max_seq_len=512, max_batch_size=1, device="cpu", dtype="float32")
    assert llama.tokenizer.chat_format == "llama2" and llama.tokenizer.n_words == 32000
    turns = check_replies_equal_fresh_and_uncached(llama, MESSAGES, system="Answer briefly.")
    assert turns[0][1].reused == 0
    for (prev, _), (turn, reply) in zip(turns, turns[1:]):
        if len(turn.dialog) > len(prev.dialog):  # the same conversation, one exchange longer
            # Everything up to the previous reply's re-encoding is reused; what is fed is about the new message.
            assert reply.reused >= len(prev.prompt) - 2
            assert reply.prefilled < len(turn.prompt) - len(prev.prompt) + 4
        else:  # after /reset: the system prompt's tokens are still shared
            assert reply.reused >= len(llama.tokenizer.encode("[INST] <<SYS>>\nAnswer briefly.", bos=True, eos=False)) - 2


@pytest.mark.slow
def test_chatml_replies_on_the_default_model_equal_fresh_runs():
    from llama.convert.fetch import default_model_dir

    llama = Llama.build(default_model_dir(), max_seq_len=1024, max_batch_size=1, device="cpu", dtype="float32")
    assert llama.tokenizer.chat_format == "chatml"
    # Short replies: the uncached runs feed the whole dialog at every step.
    turns = check_replies_equal_fresh_and_uncached(llama, MESSAGES, max_gen_len=8)
    assert any(llama.tokenizer.decode(r.tokens).strip() for _, r in turns)
    for (prev, _), (turn, reply) in zip(turns, turns[1:]):
        if len(turn.dialog) > len(prev.dialog):
            assert reply.reused >= len(prev.prompt)  # ChatML encodes message by message: a strict extension
        else:
            assert reply.reused > 20  # the default system prompt survives /reset in the cache


def test_a_full_conversation_drops_its_oldest_exchanges_and_keeps_the_system_prompt(llama2_ckpt):
    llama = Llama.build(llama2_ckpt, max_seq_len=96, max_batch_size=1, device="cpu", dtype="float32")
    system = {"role": "system", "content": "Be kind."}
    chat = Conversation(llama, system["content"], max_gen_len=12)
    dropped_any = False
    for i in range(8):
        before = list(chat.dialog)
        turn = chat.prepare(f"Message number {i}: tell me something.")
        reply = chat.respond(turn, temperature=0)
        assert turn.dialog[0] == system
        assert len(turn.prompt) + 12 <= 96
        # The dialog answered is the whole one, less its oldest exchanges: nothing is cut inside a message.
        expected = before + [{"role": "user", "content": f"Message number {i}: tell me something."}]
        assert turn.dialog == expected[:1] + expected[1 + 2 * turn.dropped:]
        (fresh,), _ = llama.generate([turn.prompt], 12, temperature=0)
        assert reply.tokens == fresh
        dropped_any |= turn.dropped > 0
    assert dropped_any

    before = list(chat.dialog)
    with pytest.raises(LlamaError, match="even without earlier turns"):
        chat.prepare("word " * 200)
    assert chat.dialog == before


def test_a_saved_conversation_resumes_with_its_cache(llama2_ckpt, tmp_path):
    llama = Llama.build(llama2_ckpt, max_seq_len=256, max_batch_size=1, device="cpu", dtype="float32")
    whole = converse(llama, MESSAGES[:3])

    first = Conversation(llama, max_gen_len=16)
    for text in MESSAGES[:2]:
        first.respond(first.prepare(text), temperature=0)
    first.save(tmp_path / "chat.kv")

    again = Llama.build(llama2_ckpt, max_seq_len=256, max_batch_size=1, device="cpu", dtype="float32")
    resumed = Conversation(again, max_gen_len=16)
    assert resumed.resume(tmp_path / "chat.kv") == 4
    assert resumed.dialog == first.dialog
    turn = resumed.prepare(MESSAGES[2])
    reply = resumed.respond(turn, temperature=0)
    assert reply.tokens == whole[2][1].tokens
    assert reply.reused == whole[2][1].reused > 0  # resuming reuses what an unbroken chat would have

    other, _ = write_tiny(tmp_path / "other", seed=4, tokenizer=llama2_tokenizer(), vocab_size=32000)
    stranger = Conversation(Llama.build(other, max_seq_len=256, max_batch_size=1, device="cpu", dtype="float32"))
    with pytest.raises(PromptCacheError, match="not by the model loaded now"):
        stranger.resume(tmp_path / "chat.kv")
    assert stranger.dialog == [] and stranger.session.tokens == []


def test_reset_after_resuming_returns_to_the_saved_system_prompt(llama2_ckpt, tmp_path):
    llama = Llama.build(llama2_ckpt, max_seq_len=256, max_batch_size=1, device="cpu", dtype="float32")
    first = Conversation(llama, "Be kind.", max_gen_len=8)
    first.respond(first.prepare(MESSAGES[0]), temperature=0)
    first.save(tmp_path / "chat.kv")
    for system in (None, "Be terse."):  # the saved conversation's system prompt wins over a new one
        resumed = Conversation(llama, system, max_gen_len=8)
        assert resumed.resume(tmp_path / "chat.kv") == 3
        resumed.reset()
        assert resumed.dialog == [{"role": "system", "content": "Be kind."}]
    # A conversation saved without a system prompt resumes without one, /reset included.
    plain = Conversation(llama, max_gen_len=8)
    plain.respond(plain.prepare(MESSAGES[0]), temperature=0)
    plain.save(tmp_path / "plain.kv")
    resumed = Conversation(llama, "Be terse.", max_gen_len=8)
    resumed.resume(tmp_path / "plain.kv")
    resumed.reset()
    assert resumed.dialog == []


@pytest.mark.slow
def test_chat_command_reports_reuse_and_resumes_a_saved_session(gqa_ckpt, tmp_path):
    """Replies are counted from the line --stats writes after each; what they say is compared whole, as the
    text the command printed (the model's text may hold line breaks of its own)."""
    messages = ["Hello there", "Tell me more", "And then?", "One more thing"]
    whole = chat(gqa_ckpt, "--stats", input="\n".join(messages) + "\n")
    stats = chat_stats(whole.stderr)
    assert len(stats) == 4 and stats[0]["reused"] == 0
    for turn in stats[1:]:
        assert turn["reused"] > 10 and "prefilled in" in turn["line"] and "tokens/s" in turn["line"]
    # 2 layers x 2 KV heads x 8 dimensions of keys and values in float32: 256 bytes a token.
    assert all(turn["line"].endswith("; kv cache on, float32, 256 bytes a token)") for turn in stats), stats

    saved = tmp_path / "chat.kv"
    first = chat(gqa_ckpt, "--session", saved, "--stats", input="\n".join(messages[:3]) + "\n")
    assert [(t["prompt"], t["reused"]) for t in chat_stats(first.stderr)] == \
        [(t["prompt"], t["reused"]) for t in stats[:3]]
    assert saved.is_file()
    resumed = chat(gqa_ckpt, "--session", saved, "--stats", input=messages[3] + "\n")
    assert "(resumed 6 messages and" in resumed.stderr
    (turn,) = chat_stats(resumed.stderr)
    # The fourth reply, resumed, reuses what the unbroken chat reused, and says what it said.
    assert (turn["prompt"], turn["reused"]) == (stats[3]["prompt"], stats[3]["reused"])
    assert first.stdout + resumed.stdout == whole.stdout

    saved.write_bytes(b"not a prompt cache")
    fresh = chat(gqa_ckpt, "--session", saved, "--stats", input=messages[0] + "\n")
    notes = [line for line in fresh.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "starting a new conversation" in notes[0]
    (turn,) = chat_stats(fresh.stderr)
    assert (turn["prompt"], turn["reused"]) == (stats[0]["prompt"], 0)
    assert whole.stdout.startswith(fresh.stdout) and fresh.stdout.endswith("\n")


@pytest.mark.slow
def test_chat_command_drops_the_oldest_exchanges_in_one_line(nonstop_ckpt):
    """Replies of exactly 8 tokens (this checkpoint's greedy runs never stop early), so the conversation
    outgrows 48 positions at the same turn whatever the weights."""
    result = chat(nonstop_ckpt, "--stats", "--max-seq-len", "48", "--system", "Be kind.", input="Hello there\n" * 5)
    notes = [line for line in result.stderr.splitlines() if "dropped the oldest" in line]
    assert notes and all(line.startswith("(the conversation no longer fits --max-seq-len 48") for line in notes)
    turns = chat_stats(result.stderr)
    assert len(turns) == 5  # every message was answered
    assert all(t["prompt"] + 8 <= 48 for t in turns)


@pytest.mark.slow
def test_chat_command_says_when_a_reply_must_be_shorter_than_asked(gqa_ckpt):
    result = chat(gqa_ckpt, "--stats", "--max-seq-len", "48", "--max-gen-len", "40", input="Hello there\n")
    notes = [line for line in result.stderr.splitlines() if "leaves room for a reply of only" in line]
    assert len(notes) == 1 and notes[0].endswith("in --max-seq-len 48; --max-gen-len asks for 40)")
    (turn,) = chat_stats(result.stderr)  # and the reply still came
    assert turn["prompt"] + 40 > 48
