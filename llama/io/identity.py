"""A model's identity: one digest that changes when any weight, the tokenizer, the dtype or the quantization does.

Files that hold computed state (prompt caches) record it, so that they are never used with another model.
Hashing a multi-gigabyte checkpoint takes seconds to minutes, so a file's digest is remembered under
$LLAMA_HOME keyed by (path, size, mtime_ns, inode): a file rewritten in place gets a new mtime and is
hashed again; an unchanged one is hashed once.
"""

import hashlib
import json
import os
from pathlib import Path
from typing import Dict, Iterable, Optional

import torch

from llama.io.checkpoint import shard_paths
from llama.runtime.files import sha256_file, write_atomically
from llama.runtime.paths import home_dir
from llama.tokenizer import CONFIG_NAME

DIGEST_CACHE_NAME = "file-digests.json"
IDENTITY_VERSION = 1  # bump when what goes into the identity changes


def _stat_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"


def _read_digest_cache(cache_path: Path) -> Dict[str, str]:
    try:
        value = json.loads(cache_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in value.items() if isinstance(v, str)} if isinstance(value, dict) else {}


def file_digests(paths: Iterable[Path], cache_path: Optional[Path] = None) -> Dict[str, str]:
    """sha256 of each file, by its name, read from (and added to) the digest cache where possible.

    Args:
        paths: the files.
        cache_path: the digest cache; default $LLAMA_HOME/file-digests.json. Not writable: no caching.
    """
    cache_path = Path(cache_path) if cache_path is not None else home_dir() / DIGEST_CACHE_NAME
    known = _read_digest_cache(cache_path)
    out, added = {}, False
    for path in paths:
        path = Path(path)
        key = _stat_key(path)
        if key not in known:
            digest = sha256_file(path)
            # One entry per path: a file that changed replaces its old entry instead of piling up.
            prefix = key.rsplit("|", 3)[0] + "|"
            known = {k: v for k, v in known.items() if not k.startswith(prefix)}
            known[key], added = digest, True
        out[path.name] = known[key]
    if added and cache_path.parent.is_dir():
        known = {k: v for k, v in known.items() if os.path.exists(k.rsplit("|", 3)[0])}  # forget deleted files
        try:
            write_atomically(cache_path, json.dumps(known, indent=0, sort_keys=True))
        except OSError:
            pass  # a read-only home only costs hashing again next time
    return out


def tensors_digest(tensors: Dict[str, torch.Tensor]) -> str:
    """sha256 over the names, dtypes, shapes and bytes of tensors, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.flatten().view(torch.uint8).numpy())
    return h.hexdigest()


def model_identity(llama) -> str:
    """The identity of a loaded model and tokenizer, as a hex digest.

    It covers the shape (params), the weights (the checkpoint's files, or the tensors in memory for a model
    that was not built from a directory), the tokenizer file and its config, the dtype and device type the
    keys and values are computed in, and the quantization (`llama.info`), with the integer kernels, which
    round activations too, apart from the exact paths.
    """
    model, info = llama.model, llama.info
    p = model.params
    if info.ckpt_dir is not None:
        ckpt_dir = info.ckpt_dir
        files = [Path(ckpt_dir) / "params.json", *shard_paths(ckpt_dir)]
        files += [f for f in (Path(ckpt_dir) / "quantization.json",) if f.is_file()]
        weights = file_digests(files)
    else:
        weights = {"in memory": tensors_digest(model.state_dict())}
    tok_path = Path(llama.tokenizer.path)
    tok_files = [tok_path] + [f for f in (tok_path.parent / CONFIG_NAME,) if f.is_file()]
    tokenizer = {f"tokenizer/{name}": d for name, d in file_digests(tok_files).items()}
    record = {
        "version": IDENTITY_VERSION,
        "params": {k: getattr(p, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size",
                                              "ffn_hidden_dim", "norm_eps", "rope_theta")},
        "dtype": str(model.dtype),
        "device": model.device.type,
        "quantization": info.quantization,
        "world_size": info.world_size,
        "weights": weights,
        "tokenizer": tokenizer,
    }
    if info.quant_kernels == "integer":  # only then, so that the identities of other models stay as they were
        record["quant_kernels"] = info.quant_kernels
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def describe_model(llama) -> str:
    """A few words naming the model, for messages: its directory's name and dtype."""
    ckpt_dir, quant = llama.info.ckpt_dir, llama.info.quantization
    name = Path(ckpt_dir).name if ckpt_dir is not None else "a model built in memory"
    dtype = str(llama.model.dtype).removeprefix("torch.")
    return f"{name} ({dtype}{', ' + quant if quant else ''})"
