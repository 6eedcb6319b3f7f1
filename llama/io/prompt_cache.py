"""Prompt-cache files: a session's keys and values on disk, with the tokens they belong to and the model.

A prompt cache is a safetensors file (tensors and a JSON header, nothing pickled):

    layers.N.keys, layers.N.values   (n_kv_heads, n_tokens, width) as the session's cache holds them, one pair per
                                     layer: width head_dim in a float dtype, or for int8 each row's values and
                                     then its scales' bytes (llama/kv_cache.py)
    header metadata (strings):
        format     "llama-kv prompt cache"
        version    FORMAT_VERSION; a newer one is refused
        model      the model's identity (llama/io/identity.py); another model's file is refused
        described  the model in words, for messages
        kv_dtype   what the keys and values are held in ("float32", "bfloat16", "int8"); a run whose KV cache
                   holds another refuses the file (files without it hold their tensors' dtype)
        tokens     JSON list of the n_tokens token ids whose keys and values the tensors hold
        dialog     JSON list of messages, for a saved chat; absent otherwise
        checksum   sha256 over the tokens, the dialog and every tensor's bytes; an edited file is refused

Files are written atomically (llama/runtime/files.py): a reader sees the old file or the new one.
"""

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch

from llama.dialog import Message
from llama.errors import LlamaError
from llama.runtime.files import write_atomically
from llama.nn.session import Session

FORMAT_NAME = "llama-kv prompt cache"
FORMAT_VERSION = 1


class PromptCacheError(LlamaError):
    """A prompt-cache file that must not be used: another model's, damaged, edited, or of a newer format."""


@dataclass
class PromptCache:
    """What a prompt-cache file holds, read and checked."""

    tokens: List[int]
    kv: List[tuple]  # per layer (keys, values), each (n_kv_heads, len(tokens), width) as a cache holds them
    dialog: Optional[List[Message]] = None
    metadata: Dict[str, str] = field(default_factory=dict)


def _checksum(tokens_json: str, dialog_json: str, tensors: Dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    h.update(tokens_json.encode() + b"\0" + dialog_json.encode() + b"\0")
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.flatten().view(torch.uint8).cpu().numpy())
    return h.hexdigest()


def check_writable(path: Path) -> None:
    """Refuse, before any slow work, a prompt-cache path that could not be written."""
    path = Path(path)
    if path.is_dir():
        raise LlamaError(f"{path} is a directory; give a file name for the prompt cache")
    if not path.parent.is_dir():
        raise LlamaError(f"the folder {path.parent} for the prompt cache {path.name} does not exist")


def save_prompt_cache(path: Path, session: Session, identity: str, described: str = "",
                      dialog: Optional[List[Message]] = None) -> Path:
    """Write what `session` holds to `path`, atomically.

    Args:
        path: the file to write (replaced if it exists).
        session: the session whose tokens and keys and values are stored.
        identity: `llama.io.identity.model_identity` of the model that computed them.
        described: the model in a few words, for messages.
        dialog: the conversation these tokens encode, for a saved chat.
    """
    tensors = {}
    for i, (k, v) in enumerate(session.kv_tensors()):
        tensors[f"layers.{i}.keys"] = k.contiguous().cpu()
        tensors[f"layers.{i}.values"] = v.contiguous().cpu()
    tokens_json = json.dumps(list(session.tokens))
    dialog_json = json.dumps(dialog, ensure_ascii=False) if dialog is not None else ""
    metadata = {
        "format": FORMAT_NAME,
        "version": str(FORMAT_VERSION),
        "model": identity,
        "described": described,
        "kv_dtype": _dtype_name(session.model.kv_cache_dtype),
        "tokens": tokens_json,
        "checksum": _checksum(tokens_json, dialog_json, tensors),
    }
    if dialog is not None:
        metadata["dialog"] = dialog_json
    from safetensors.torch import save as safetensors_bytes  # here: most runs never save a prompt cache

    return write_atomically(Path(path), safetensors_bytes(tensors, metadata=metadata))


def load_prompt_cache(path: Path, identity: str, n_layers: int, kv_dtype: Optional[torch.dtype] = None) -> PromptCache:
    """Read and check a prompt-cache file written for the model whose identity is `identity`, whose KV cache holds
    keys and values in `kv_dtype` (None: not checked).

    Raises:
        PromptCacheError: the file is missing, not a prompt cache, truncated, edited, from a newer format,
            from another model, or holds keys and values in another dtype. The message is one sentence naming the file.
    """
    path = Path(path)
    if not path.is_file():
        raise PromptCacheError(f"prompt cache {path} does not exist")
    from safetensors import safe_open  # here: most runs never read a prompt cache

    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            _check_header(path, metadata, identity)
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except PromptCacheError:
        raise
    except Exception as e:  # safetensors reports a damaged or truncated file with several exception types
        raise PromptCacheError(f"prompt cache {path} is damaged or truncated ({_first_line(e)})") from None

    tokens_json, dialog_json = metadata.get("tokens", ""), metadata.get("dialog", "")
    if metadata.get("checksum") != _checksum(tokens_json, dialog_json, tensors):
        raise PromptCacheError(f"prompt cache {path} was changed after it was written (its checksum does not match)")
    try:
        tokens = json.loads(tokens_json)
        dialog = json.loads(dialog_json) if dialog_json else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise ValueError("tokens must be a list of integers")
        if dialog is not None and not (isinstance(dialog, list) and all(_is_message(m) for m in dialog)):
            raise ValueError("the dialog must be a list of messages")
        kv = [(tensors[f"layers.{i}.keys"], tensors[f"layers.{i}.values"]) for i in range(n_layers)]
        if len(tensors) != 2 * n_layers:
            raise ValueError(f"{len(tensors) // 2} layers where {n_layers} belong")
        if any(k.shape[1] != len(tokens) or v.shape != k.shape for k, v in kv):
            raise ValueError("the keys and values do not cover the tokens")
        held = metadata.get("kv_dtype") or (_dtype_name(kv[0][0].dtype) if kv else "")
        if any(_dtype_name(t.dtype) != held for pair in kv for t in pair):
            raise ValueError(f"its header says {held} keys and values, its tensors hold another dtype")
    except (ValueError, KeyError, TypeError, LlamaError) as e:
        raise PromptCacheError(f"prompt cache {path} is malformed ({_first_line(e)})") from None
    if kv_dtype is not None and kv and held != _dtype_name(kv_dtype):
        raise PromptCacheError(f"prompt cache {path} holds keys and values in {held}, not in {_dtype_name(kv_dtype)} "
                               f"as this run's KV cache does (kv_cache_dtype={held} reads it)")
    return PromptCache(tokens, kv, dialog, metadata)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_header(path: Path, metadata: Dict[str, str], identity: str) -> None:
    if metadata.get("format") != FORMAT_NAME:
        raise PromptCacheError(f"{path} is not a llama-kv prompt cache")
    version = metadata.get("version", "")
    if not version.isdigit():
        raise PromptCacheError(f"prompt cache {path} has no valid format version")
    if int(version) > FORMAT_VERSION:
        raise PromptCacheError(f"prompt cache {path} has format {version}, newer than this version of llama-kv "
                               f"reads ({FORMAT_VERSION}); upgrade llama-kv or delete the file")
    if int(version) < FORMAT_VERSION:
        raise PromptCacheError(f"prompt cache {path} has an old format ({version})")
    if metadata.get("model") != identity:
        made_for = metadata.get("described") or "another model"
        raise PromptCacheError(f"prompt cache {path} was made by {made_for}, not by the model loaded now "
                               "(its weights, tokenizer, dtype or quantization differ)")


def _is_message(m) -> bool:
    return (isinstance(m, dict) and set(m) == {"role", "content"} and m["role"] in ("system", "user", "assistant")
            and isinstance(m["content"], str))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def restore(session: Session, cache: PromptCache) -> int:
    """Put a loaded prompt cache into `session` (as much as fits); returns the number of tokens held.

    Raises:
        PromptCacheError: the tensors do not fit the session's model.
    """
    n = min(len(cache.tokens), session.max_seq_len)
    try:
        session.load(cache.tokens[:n], [(k[:, :n], v[:, :n]) for k, v in cache.kv])
    except (ValueError, RuntimeError) as e:
        raise PromptCacheError(f"the prompt cache does not fit the model ({_first_line(e)})") from None
    return n
