"""A chat kept across turns: its messages, a KV cache that outlives each reply, and what happens when the
conversation outgrows the context.

Every turn encodes the whole dialog in the model's chat format, as a fresh run would; the session
(llama/nn/session.py) then feeds only the tokens after the longest prefix its cache already holds. So each
reply is the one a fresh process would give for the same dialog, at the cost of the new tokens only.

When the dialog plus room for a reply (max_gen_len tokens) no longer fits max_seq_len, the oldest
exchanges (a user message and its reply) are dropped, the system prompt kept, until it does. A single
message too long to fit is refused whole: nothing is ever cut inside a message.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Union

from llama.constraint import Grammar
from llama.dialog import Dialog, Message
from llama.errors import LlamaError
from llama.generation import Llama, StepCallback
from llama.io.identity import describe_model, model_identity
from llama.io.prompt_cache import load_prompt_cache, restore, save_prompt_cache
from llama.nn.session import Session
from llama.sampling import SamplingControls
from llama.speculative import DEFAULT_DRAFT_TOKENS, Drafter, check_speculation


@dataclass
class Turn:
    """A user message ready to be answered."""

    dialog: Dialog  # the messages the reply answers, the new one last, after any dropping
    prompt: List[int]  # their tokens
    dropped: int  # earlier exchanges dropped to make room
    max_gen_len: int  # the most tokens the reply may have (less than asked when the context is nearly full)


@dataclass
class Reply:
    text: str
    tokens: List[int]
    reused: int  # prompt tokens whose keys and values came from the cache
    prefilled: int  # prompt tokens fed to the model


class Conversation:
    """The state of a chat between turns.

    Args:
        llama: the model.
        system: a system prompt that starts the conversation and survives `reset` and dropped turns.
        max_gen_len: the most tokens of one reply; the dialog is shortened to leave this much room.
        kv_cache: keep keys and values between turns (a Session); False runs every step without a cache.
        speculate, draft_tokens: speculative decoding, as `Llama.generate` takes it: the same replies.
    """

    def __init__(self, llama: Llama, system: Optional[str] = None, max_gen_len: int = 512, kv_cache: bool = True,
                 speculate: Union[str, Drafter, None] = None, draft_tokens: int = DEFAULT_DRAFT_TOKENS):
        check_speculation(speculate, draft_tokens, kv_cache)
        self.llama = llama
        self.speculate, self.draft_tokens = speculate, draft_tokens
        self.start: Dialog = [{"role": "system", "content": system}] if system else []
        self.dialog: Dialog = list(self.start)
        self.max_gen_len = max_gen_len
        self.kv_cache = kv_cache
        self.session: Optional[Session] = Session(llama.model) if kv_cache else None
        self._identity: Optional[str] = None

    def reset(self) -> None:
        """Start over from the system prompt. The cache is kept: the next prompt's common prefix (the
        system prompt, at least) is still reused."""
        self.dialog = list(self.start)

    def prepare(self, text: str) -> Turn:
        """The turn for the user's message `text`, dropping the oldest exchanges if the dialog must shrink.

        Raises:
            LlamaError: the message (with the system prompt) leaves no room for a reply in max_seq_len.
        """
        max_seq_len = self.llama.model.params.max_seq_len
        head = 1 if self.dialog and self.dialog[0]["role"] == "system" else 0
        candidate = self.dialog + [{"role": "user", "content": text}]
        prompt = self.llama.dialog_tokens(candidate)
        dropped = 0
        while len(prompt) + self.max_gen_len > max_seq_len and len(candidate) - head > 1:
            candidate = candidate[:head] + candidate[head + 2:]  # the oldest user message and its reply
            prompt = self.llama.dialog_tokens(candidate)
            dropped += 1
        room = max_seq_len - len(prompt)
        if room < 1:
            raise LlamaError(f"this message makes a prompt of {len(prompt)} tokens even without earlier turns, "
                             f"which fills max_seq_len={max_seq_len}; send a shorter one")
        return Turn(candidate, prompt, dropped, min(self.max_gen_len, room))

    def respond(self, turn: Turn, temperature: float = 0.6, top_p: float = 0.9,
                on_step: Optional[StepCallback] = None, controls: Optional[SamplingControls] = None,
                grammar: Optional[Grammar] = None) -> Reply:
        """Generate the reply to `turn` and add the exchange to the conversation (`controls` and `grammar`: as
        `generate` takes them)."""
        (tokens,), _ = self.llama.generate([turn.prompt], turn.max_gen_len, temperature, top_p,
                                           kv_cache=self.kv_cache, on_step=on_step, session=self.session,
                                           speculate=self.speculate, draft_tokens=self.draft_tokens, controls=controls,
                                           grammar=grammar)
        text = self.llama.tokenizer.decode(tokens)
        self.dialog = turn.dialog + [{"role": "assistant", "content": text}]
        if self.session is not None:
            reused, prefilled = self.session.last_reused, self.session.last_prefilled
        else:
            reused, prefilled = 0, len(turn.prompt)
        return Reply(text, tokens, reused, prefilled)

    def identity(self) -> str:
        if self._identity is None:
            self._identity = model_identity(self.llama)
        return self._identity

    def save(self, path: Path) -> None:
        """Write the conversation and its KV cache to `path` (atomically), to be resumed by `resume`."""
        if self.session is None:
            raise LlamaError("saving a conversation keeps its KV cache, so it needs the cache on")
        save_prompt_cache(path, self.session, self.identity(), describe_model(self.llama), dialog=self.dialog)

    def resume(self, path: Path) -> int:
        """Continue the conversation saved in `path`; returns how many of its messages were restored.

        Raises:
            PromptCacheError: the file must not be used (another model's, another KV dtype's, damaged, edited, newer
                format);
                the conversation is left as it was.
        """
        if self.session is None:
            raise LlamaError("resuming a conversation restores its KV cache, so it needs the cache on")
        saved = load_prompt_cache(path, self.identity(), self.llama.model.n_layers, self.llama.model.kv_cache_dtype)
        restore(self.session, saved)
        messages: List[Message] = saved.dialog or []
        if messages:
            self.dialog = list(messages)
            # What /reset returns to: the resumed conversation's own system prompt, or none if it had none.
            self.start = [messages[0]] if messages[0]["role"] == "system" else []
        return len(messages)
