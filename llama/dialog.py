"""How a dialog becomes prompt tokens: LLaMA-2's `[INST]` / `<<SYS>>` format, or ChatML's
`<|im_start|>role ... <|im_end|>` turns (SmolLM2, Qwen and others), as the tokenizer's config says."""

from typing import List, Literal, Sequence, TypedDict

from llama.errors import LlamaError

Role = Literal["system", "user", "assistant"]


class Message(TypedDict):
    role: Role
    content: str


Dialog = List[Message]

B_INST, E_INST = "[INST]", "[/INST]"
B_SYS, E_SYS = "<<SYS>>\n", "\n<</SYS>>\n\n"
SPECIAL_TAGS = [B_INST, E_INST, "<<SYS>>", "<</SYS>>"]
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHATML_TAGS = [IM_START, IM_END]
UNSAFE_ERROR = "Error: special tags are not allowed as part of the prompt."


def has_special_tags(dialog: Dialog, chat_format: str = "llama2") -> bool:
    """Whether any message smuggles in the format's own tags, which would let it forge turns."""
    tags = CHATML_TAGS if chat_format == "chatml" else SPECIAL_TAGS
    return any(tag in msg["content"] for tag in tags for msg in dialog)


def check_dialog(dialog: Sequence[Message]) -> None:
    if not dialog:
        raise LlamaError("a dialog needs at least one message")
    for msg in dialog:
        if not isinstance(msg, dict) or not isinstance(msg.get("content"), str) or "role" not in msg:
            raise LlamaError(f"each message must be a dict with a role and a string content, not {msg!r}")
    turns = dialog[1:] if dialog[0]["role"] == "system" else dialog
    for i, msg in enumerate(turns):
        expected = "user" if i % 2 == 0 else "assistant"
        if msg["role"] != expected:
            raise LlamaError(
                "after an optional system message, roles must alternate user, assistant, user, ...; "
                f"message {i + (len(dialog) - len(turns))} is {msg['role']!r} where {expected!r} belongs"
            )
    if turns[-1]["role"] != "user":
        raise LlamaError("the last message of a dialog must be the user's")


def encode_dialog_llama2(tokenizer, dialog: Dialog) -> List[int]:
    """Prompt tokens for a dialog in LLaMA-2's chat format: each finished exchange is its own
    bos ... eos sequence, and the last user message is left open for the reply."""
    check_dialog(dialog)
    if dialog[0]["role"] == "system":
        dialog = [{"role": "user", "content": B_SYS + dialog[0]["content"] + E_SYS + dialog[1]["content"]}] + list(dialog[2:])
    tokens: List[int] = []
    for prompt, answer in zip(dialog[::2], dialog[1::2]):
        tokens += tokenizer.encode(
            f"{B_INST} {prompt['content'].strip()} {E_INST} {answer['content'].strip()} ", bos=True, eos=True
        )
    tokens += tokenizer.encode(f"{B_INST} {dialog[-1]['content'].strip()} {E_INST}", bos=True, eos=False)
    return tokens


def encode_dialog_chatml(tokenizer, dialog: Dialog) -> List[int]:
    """Prompt tokens for a dialog in ChatML, ending with an open assistant turn:

        <|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n ... <|im_start|>assistant\n

    A dialog without a system message gets the tokenizer's default system prompt, as SmolLM2's chat
    template writes one. Tags inside a message's text would still become tag tokens, exactly as the
    model's own Jinja template lets them; `has_special_tags(dialog, "chatml")` tells such dialogs apart.
    """
    check_dialog(dialog)
    im_start, im_end = tokenizer.token_to_id(IM_START), tokenizer.token_to_id(IM_END)
    if im_start is None or im_end is None:
        raise LlamaError(f"the tokenizer {tokenizer.path} has no {IM_START} and {IM_END} tokens, so it cannot use the chatml format")
    default_system = getattr(tokenizer, "default_system_prompt", None)
    if dialog[0]["role"] != "system" and default_system is not None:
        dialog = [{"role": "system", "content": default_system}] + list(dialog)
    tokens: List[int] = []
    for msg in dialog:
        # Splitting at the tags is what a Hugging Face tokenizer does to the whole rendered template too,
        # so encoding the pieces between them gives the same ids.
        tokens += [im_start] + _encode(tokenizer, f"{msg['role']}\n{msg['content']}") + [im_end]
        tokens += _encode(tokenizer, "\n")
    return tokens + [im_start] + _encode(tokenizer, "assistant\n")


def _encode(tokenizer, text: str) -> List[int]:
    return tokenizer.encode(text, bos=False, eos=False)


def encode_dialog(tokenizer, dialog: Dialog) -> List[int]:
    """Prompt tokens for a dialog in the tokenizer's chat format (`tokenizer.chat_format`, LLaMA-2's when unset)."""
    chat_format = getattr(tokenizer, "chat_format", "llama2")
    if chat_format == "chatml":
        return encode_dialog_chatml(tokenizer, dialog)
    if chat_format == "llama2":
        return encode_dialog_llama2(tokenizer, dialog)
    raise LlamaError(f"unknown chat format {chat_format!r}; expected llama2 or chatml")
