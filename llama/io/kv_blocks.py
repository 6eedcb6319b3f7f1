"""KV-cache block files: one block of keys and values on disk, with the tokens it follows and the model that made it.

The keys and values of a block's positions depend on every token before them, so a block is named by its chain:

    key(block i) = sha256(namespace, key(block i - 1) or "" for the first, block i's token ids)
    namespace    = sha256(format version, model identity, KV dtype, block size, layer shapes)

Two prompts get the same key for block i exactly when their first (i + 1) * block_size ids are the same and the
same model computed them in the same dtype, in blocks of the same size. A file is

    MAGIC                    b"llama-kv block\\n"
    4 bytes                  the length of the JSON header, little-endian
    JSON header              version, model, dtype, block_size, shapes [n_layers, n_kv_heads, width], key, parent
                             (the key before it), tokens (this block's ids), payload_bytes, checksum (sha256 of the
                             payload)
    payload                  (n_layers, 2, n_kv_heads, block_size, width) in dtype, keys before values, as the paged
                             cache holds them: width is head_dim for a float dtype; for int8 each row is its head_dim
                             values and then the bytes of their float32 scales (llama/kv_cache.py), so an int8
                             block's payload carries its scales and its name differs from a float block's

A reader checks every header field against what it expects and the payload against its checksum, and refuses
a truncated, edited or foreign file (another model, dtype, block size, shape or format version) with a
`BlockFileError` saying which.
"""

import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Sequence, Tuple

import torch

from llama.errors import LlamaError

MAGIC = b"llama-kv block\n"
FORMAT_VERSION = 1
SUFFIX = ".kvblock"
_LENGTH = struct.Struct("<I")
_MAX_HEADER = 1 << 20  # a header is ids and digests: far less; more is a damaged length


class BlockFileError(LlamaError):
    """A block file that must not be loaded: damaged, edited, or made by another model or in another layout."""


@dataclass(frozen=True)
class BlockSpec:
    """What a block file must match: the model, the KV dtype, the block size and the layers' shapes.

    Args:
        identity: the model's identity (llama/io/identity.py).
        dtype: the dtype the KV cache holds keys and values in.
        block_size: positions per block.
        shapes: (n_layers, n_kv_heads, width): width is head_dim, or an int8 row's values and scales' bytes.
    """

    identity: str
    dtype: torch.dtype
    block_size: int
    shapes: Tuple[int, int, int]
    namespace: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        record = json.dumps([FORMAT_VERSION, self.identity, self.dtype_name, self.block_size, list(self.shapes)])
        object.__setattr__(self, "namespace", hashlib.sha256(record.encode()).digest())

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def payload_bytes(self) -> int:
        n_layers, n_kv_heads, width = self.shapes
        return n_layers * 2 * n_kv_heads * self.block_size * width * self.dtype.itemsize

    def key(self, parent: str, tokens: Sequence[int]) -> str:
        """The key of a block holding `tokens`, after the block whose key is `parent` ("" for the first)."""
        h = hashlib.sha256(self.namespace)
        h.update(parent.encode() + b"|")
        h.update(struct.pack(f"<{len(tokens)}q", *tokens))
        return h.hexdigest()

    def chain_keys(self, tokens: Sequence[int], n_blocks: int, known: List[str]) -> List[str]:
        """The keys of the first `n_blocks` full blocks of `tokens`, extending `known` (the keys of its first
        len(known) blocks, computed before: a sequence's earlier tokens never change) in place."""
        bs = self.block_size
        while len(known) < n_blocks:
            i = len(known)
            known.append(self.key(known[-1] if i else "", tokens[i * bs : (i + 1) * bs]))
        return known


def block_file_bytes(spec: BlockSpec, parent: str, tokens: Sequence[int], kv: torch.Tensor) -> bytes:
    """The bytes of the file for one block: `kv` (n_layers, 2, n_kv_heads, block_size, width) holding the keys and
    values of `tokens`, which follow the block whose key is `parent`."""
    n_layers, n_kv_heads, width = spec.shapes
    assert tuple(kv.shape) == (n_layers, 2, n_kv_heads, spec.block_size, width) and kv.dtype == spec.dtype
    payload = kv.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()
    header = json.dumps({
        "version": FORMAT_VERSION, "model": spec.identity, "dtype": spec.dtype_name, "block_size": spec.block_size,
        "shapes": list(spec.shapes), "key": spec.key(parent, tokens), "parent": parent, "tokens": list(tokens),
        "payload_bytes": len(payload), "checksum": hashlib.sha256(payload).hexdigest(),
    }, sort_keys=True).encode()
    return MAGIC + _LENGTH.pack(len(header)) + header + payload


def read_block_file(path: Path, spec: BlockSpec, parent: str, tokens: Sequence[int]) -> torch.Tensor:
    """The keys and values a block file holds for `tokens` after the block whose key is `parent`, checked.

    Returns:
        (n_layers, 2, n_kv_heads, block_size, width) in spec.dtype, on the CPU.

    Raises:
        FileNotFoundError: there is no such file.
        BlockFileError: the file is truncated, edited, or not of this model, dtype, block size, shapes, format
            version or chain of tokens; the message says which, in a few words.
    """
    with open(path, "rb") as f:
        data = bytearray(f.read())
    start = len(MAGIC) + _LENGTH.size
    if len(data) < start or data[: len(MAGIC)] != MAGIC:
        raise BlockFileError("not a KV block file" if len(data) >= start else "truncated")
    (header_len,) = _LENGTH.unpack_from(data, len(MAGIC))
    if header_len > _MAX_HEADER:
        raise BlockFileError("its header is damaged")
    if len(data) < start + header_len:
        raise BlockFileError("truncated")
    try:
        header = json.loads(bytes(data[start : start + header_len]))
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except ValueError:
        raise BlockFileError("its header is damaged") from None
    _check_header(header, spec, parent, tokens)
    payload = memoryview(data)[start + header_len :]
    if len(payload) != spec.payload_bytes:
        raise BlockFileError("truncated" if len(payload) < spec.payload_bytes else "it has bytes past its payload")
    if hashlib.sha256(payload).hexdigest() != header.get("checksum"):
        raise BlockFileError("its payload was changed after it was written (the checksum does not match)")
    n_layers, n_kv_heads, width = spec.shapes
    kv = torch.frombuffer(data, dtype=torch.uint8, offset=start + header_len, count=len(payload))
    return kv.view(spec.dtype).view(n_layers, 2, n_kv_heads, spec.block_size, width)


def _check_header(header: dict, spec: BlockSpec, parent: str, tokens: Sequence[int]) -> None:
    if header.get("version") != FORMAT_VERSION:
        raise BlockFileError(f"format version {header.get('version')!r}, not {FORMAT_VERSION}")
    if header.get("model") != spec.identity:
        raise BlockFileError("made by another model (its weights, tokenizer, dtype or quantization differ)")
    if header.get("dtype") != spec.dtype_name:
        raise BlockFileError(f"keys and values in {header.get('dtype')}, not {spec.dtype_name}")
    if header.get("block_size") != spec.block_size:
        raise BlockFileError(f"blocks of {header.get('block_size')} positions, not {spec.block_size}")
    if header.get("shapes") != list(spec.shapes):
        raise BlockFileError(f"layers shaped {header.get('shapes')}, not {list(spec.shapes)}")
    if header.get("parent") != parent or header.get("tokens") != list(tokens) or \
            header.get("key") != spec.key(parent, tokens):
        raise BlockFileError("it holds another chain of tokens than its name says")
    if header.get("payload_bytes") != spec.payload_bytes:
        raise BlockFileError(f"a payload of {header.get('payload_bytes')} bytes, not {spec.payload_bytes}")
