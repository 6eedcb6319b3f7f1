"""Tokenizer files for a converted checkpoint: a Hugging Face `tokenizer.json` rebuilt from a GGUF
byte-level BPE vocabulary, and the `tokenizer_config.json` that `llama.tokenizer.Tokenizer` reads.

A GGUF file stores a BPE vocabulary as lists (tokens, merges, token types) plus the name of the
pre-tokenizer llama.cpp applies (`tokenizer.ggml.pre`). The name stands for a split rule that the file
does not spell out, so the rules this converter knows are written out in `PRE_TOKENIZERS` below.
"""

from typing import Any, Callable, Dict, List, Optional

from llama.errors import LlamaError

# llama.cpp's token types (llama_token_type).
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4

# GPT-2's split: contractions, letters, numbers and other symbols, each run with one optional leading
# space, and whitespace not followed by a non-space.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# LLaMA-3's split: numbers in groups of at most three, letters with one leading non-letter, newlines apart.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's split: LLaMA-3's with single digits.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _byte_level(split: str, digits: bool = False) -> Callable[[], Any]:
    def build():
        from tokenizers import Regex, pre_tokenizers

        steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
        if split == _GPT2_SPLIT:
            # The ByteLevel pre-tokenizer's own regex is GPT-2's.
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
        else:
            steps += [pre_tokenizers.Split(Regex(split), behavior="isolated"),
                      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    return build


# tokenizer.ggml.pre -> the pre-tokenizer llama.cpp applies for it (llama-vocab.cpp). SmolLM2 and the
# StarCoder family put every digit on its own, then split as GPT-2 does.
PRE_TOKENIZERS: Dict[str, Callable[[], Any]] = {
    "default": _byte_level(_GPT2_SPLIT),
    "gpt-2": _byte_level(_GPT2_SPLIT),
    "smollm": _byte_level(_GPT2_SPLIT, digits=True),
    "starcoder": _byte_level(_GPT2_SPLIT, digits=True),
    "refact": _byte_level(_GPT2_SPLIT, digits=True),
    "llama-bpe": _byte_level(_LLAMA3_SPLIT),
    "llama3": _byte_level(_LLAMA3_SPLIT),
    "qwen2": _byte_level(_QWEN2_SPLIT),
}


def byte_level_tokenizer_json(tokens: List[str], merges: List[str], token_types: Optional[List[int]],
                              pre: Optional[str], source: str) -> bytes:
    """A Hugging Face `tokenizer.json` for a GGUF byte-level BPE vocabulary (`tokenizer.ggml.model` "gpt2").

    Args:
        tokens: `tokenizer.ggml.tokens`, spelled in GPT-2's byte alphabet as the file stores them.
        merges: `tokenizer.ggml.merges`, each "left right".
        token_types: `tokenizer.ggml.token_type`; control tokens become special added tokens and
            user-defined ones plain added tokens, so both are matched whole in text.
        pre: `tokenizer.ggml.pre`, naming the pre-tokenizer (None: GPT-2's).
        source: the file, for messages.

    Returns:
        The JSON text, UTF-8.

    Raises:
        LlamaError: the pre-tokenizer is not one this converter knows, or the lists are inconsistent.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models

    pre = pre or "default"
    if pre not in PRE_TOKENIZERS:
        raise LlamaError(
            f"{source} uses the pre-tokenizer {pre!r}, which llama-convert does not know (it knows "
            f"{', '.join(sorted(PRE_TOKENIZERS))}); convert the model from its Hugging Face directory instead"
        )
    if token_types is not None and len(token_types) != len(tokens):
        raise LlamaError(f"{source} has {len(tokens)} tokens but {len(token_types)} token types; the vocabulary is inconsistent")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise LlamaError(f"{source} lists the same token twice in tokenizer.ggml.tokens; the vocabulary is inconsistent")
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise LlamaError(f"{source} has the merge {merge!r}, which is not two tokens separated by a space")
        pairs.append((left, right))

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    types = token_types or [TOKEN_NORMAL] * len(tokens)
    # Added tokens keep their ids from the vocabulary above; they only stop the splitter from cutting them.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types) if kind == TOKEN_CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind in zip(tokens, types) if kind == TOKEN_USER_DEFINED])
    if tokenizer.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise LlamaError(f"{source}: rebuilding its tokenizer changed the vocabulary size; the vocabulary is inconsistent")
    return tokenizer.to_str().encode("utf-8")


def tokenizer_config(tokens: List[str], bos_id: Optional[int], eos_id: Optional[int], pad_id: Optional[int],
                     add_bos: bool, chat_template: Optional[str], extra_stop_tokens: List[str] = ()) -> Dict[str, Any]:
    """The `tokenizer_config.json` fields (see `llama.tokenizer`) for a vocabulary and its special ids.

    The chat format is read off the chat template; ChatML models stop at `<|im_end|>` as well as at eos,
    and a system prompt the template writes when a dialog has none is kept as `default_system_prompt`.
    """

    def token(i: Optional[int]) -> Optional[str]:
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    config: Dict[str, Any] = {"bos_token": token(bos_id), "eos_token": token(eos_id), "pad_token": token(pad_id),
                              "add_bos_token": bool(add_bos)}
    stops = [t for t in [token(eos_id), *extra_stop_tokens] if t is not None]
    chat_format = "chatml" if chat_template and "<|im_start|>" in chat_template else "llama2"
    config["chat_format"] = chat_format
    if chat_format == "chatml":
        stops += [t for t in ("<|im_end|>", "<|endoftext|>") if t in tokens]
        system = default_system_prompt(chat_template)
        if system is not None:
            config["default_system_prompt"] = system
    config["stop_tokens"] = list(dict.fromkeys(stops))  # no repeats, first-seen order
    if chat_template:
        config["chat_template"] = chat_template
    return {k: v for k, v in config.items() if v is not None}


def default_system_prompt(chat_template: str) -> Optional[str]:
    """The system message a ChatML template writes for a dialog without one, or None.

    Templates such as SmolLM2's write it as one literal, `'<|im_start|>system<newline>...<|im_end|>'`; the
    Jinja source is not run, only that literal is looked for (with the newline real or escaped).
    """
    for newline in ("\n", "\\n"):
        marker = "<|im_start|>system" + newline
        start = chat_template.find(marker)
        end = chat_template.find("<|im_end|>", start)
        if start < 0 or end < 0:
            continue
        body = chat_template[start + len(marker):end]
        # Only plain text counts: a quote or brace means the message comes from a variable.
        if any(c in body for c in "'\"{}+"):
            return None
        return body.replace("\\n", "\n")
    return None
