"""The library speaks in its parameters' names; the commands say the same in their flags."""

import pytest

from llama.cli.common import as_flags


@pytest.mark.parametrize("library, command", [
    ("try dtype=float32", "try --dtype float32"),
    ("run without compile=True (or try X)", "run without --compile (or try X)"),
    ("leave quantize= out to run it as stored", "leave --quantize out to run it as stored"),
    ("these would fit: quantize=int4 dtype=bfloat16 (9.1 GiB)", "these would fit: --quantize int4 --dtype bfloat16 (9.1 GiB)"),
    ("which fills max_seq_len=48; send a shorter one", "which fills --max-seq-len 48; send a shorter one"),
    ("pass its path with tokenizer_path=", "pass its path with --tokenizer-path"),
    ("about 3 times slower (compile=False hides this note)", "about 3 times slower (--no-compile hides this note)"),
    ("the same answers with kv_cache=False", "the same answers with --no-kv-cache"),
])
def test_parameters_become_flags(library, command):
    assert as_flags(library) == command


def test_other_text_with_equals_signs_is_left_alone():
    text = "tensor x has torch_dtype=float16 and a=b; the cache_dtype=bfloat16 stays"
    assert as_flags(text) == text
