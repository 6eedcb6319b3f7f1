"""An opt-in compiled generation step: torch.compile applied to a built model from outside.

Only the steps after the prompt are compiled (one token with the KV cache, the growing prefix without
it); the prompt runs eagerly, so a new prompt length never costs a compilation. Positions, the KV cache's
length and (without the cache) the prefix length are compiled as symbolic sizes, so one compilation
serves every step of every later call with the same batch size.
"""

import logging
import os
import re
import warnings
from typing import Callable, List, Optional

import torch

from llama.errors import LlamaError
from llama.kv_cache import KVCache
from llama.linears import choose_layer_classes
from llama.model import Transformer

Step = Callable[[torch.Tensor, int, Optional[List[KVCache]], Optional[int]], torch.Tensor]

# Sources (the compiled forward's arguments, as Dynamo names them) whose values change from step to step.
# Left static, each new value would trigger a compilation, each of them slow (docs/benchmarks.md).
_DYNAMIC_SOURCES = ",".join([
    re.escape("L['start_pos']"),
    re.escape("L['tokens']") + ":1",  # the prefix fed without a cache (1 with it, which stays static)
    re.escape("L['cache']") + r".*_buffers\['cache_[kv]'\]:2",  # the cache's length, new for each call
])


# Compilations Dynamo keeps for the model's forward, across every compiled model in the process. Each kind of
# step (with or without the cache, a batch size, float or quantized layers) is one; the default of 8 is
# reached by a process that compiles a float, an int8 and an int4 model, as a benchmark comparing them does,
# or that builds a compiled model and then serves it (llama/server/runner.py). With fullgraph=True, passing the
# limit is an error, not a slower eager step.
RECOMPILE_LIMIT = 64


def quiet_inductor() -> None:
    """Hold back Inductor's messages about its own choices, for the rest of the process: the rotary
    embedding's complex product, and with the C++ wrapper some view ops, go through slower generic calls.
    That is its business, not the user's, and it would print them at every compilation."""
    logging.getLogger("torch._inductor.ir").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="Torchinductor does not support code generation for complex")
    # torch 2.15, where a bf16 step reads an int4 layer's float16 scales.
    warnings.filterwarnings("ignore", message="bf16 and fp16 are mixed in the scheduler node")


def compile_step(model: Transformer) -> Step:
    """A compiled version of `model.forward` for the steps after the prompt; it shares the model's weights.

    The model's linear layers become the compiled step's classes in place (llama/linears.py: the same
    weights, the same state_dict, exact eager behaviour). Float weights should be stored as they load
    (row-major): the reduction reads each row contiguously. The one-token step at batch 1 is compiled here, before returning; other batch sizes,
    and the uncached step, compile at their first call.

    Raises:
        LlamaError: torch.compile could not build the step (on the CPU it needs a C++ compiler).
    """
    choose_layer_classes(model, compiled=True)
    compiled = torch.compile(model, fullgraph=True)
    quiet_inductor()
    # On the CPU the step's kernels are called from generated C++ rather than Python: more tokens/s, the most
    # where the step is shortest, for a longer first compilation (scripts/compare_compiled.py; figures in
    # docs/benchmarks.md). LLAMA_COMPILE_CPP_WRAPPER=0 turns it off, to measure the difference or to work
    # around a torch bug.
    cpp_wrapper = (model.device.type == "cpu"
                   and os.environ.get("LLAMA_COMPILE_CPP_WRAPPER", "1") != "0")

    def step(tokens: torch.Tensor, start_pos: int, cache: Optional[List[KVCache]], num_logits: Optional[int] = None):
        with torch.compiler.config.patch(dynamic_sources=_DYNAMIC_SOURCES), \
                torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT), \
                torch._inductor.config.patch(cpp_wrapper=cpp_wrapper):
            return compiled(tokens, start_pos, cache, num_logits=num_logits)

    try:
        # Under inference mode, as generate() runs: tensors made outside it would not match the guards.
        with torch.inference_mode():
            tokens = torch.zeros((1, 3), dtype=torch.long, device=model.device)
            # Sizes and positions of 0 or 1 would be compiled as constants, and a step that fills the cache
            # exactly as a special case; generate() never fills its cache (the last token is not fed).
            cache = model.new_kv_cache(1, 4)
            model(tokens[:, :2], 0, cache)
            step(tokens[:, 2:], 2, cache, num_logits=1)
    except Exception as e:  # Inductor's failures (no compiler, a bad toolchain) come as many exception types
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        hint = " (or try LLAMA_COMPILE_CPP_WRAPPER=0)" if cpp_wrapper else ""
        raise LlamaError(f"compile=True failed: torch.compile could not build the decode step ({reason}); "
                         f"run without compile=True{hint}") from e
    return step
