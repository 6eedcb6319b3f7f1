"""How a dialog becomes prompt tokens: LLaMA-2's `[INST]` / `<<SYS>>` format."""

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
UNSAFE_ERROR = "Error: special tags are not allowed as part of the prompt."


def has_special_tags(dialog: Dialog) -> bool:
    """Whether any message smuggles in the format's own tags, which would let it forge turns."""
    return any(tag in msg["content"] for tag in SPECIAL_TAGS for msg in dialog)


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
