"""`plan_run` decides a load's every path from the flags and the facts alone; `Llama.build` carries the plan out."""

from dataclasses import replace

import pytest
import torch

from llama import Llama
from llama.errors import LlamaError
from llama.quant.layer_plan import Kernels
from llama.run_plan import Facts, ModelFlags, plan_run

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
INT8 = {"layers.0.attention.wq.weight": ("int8", None)}
OURS = Kernels(llama_kv=True)


def facts(device=CPU, world_size=1, stored_step=True, quant=None, dtype=torch.float32, kernels=OURS, missing=None):
    return Facts(device, world_size, stored_step, quant or {}, dtype, (), kernels, missing)


def flags(**kwargs) -> ModelFlags:
    return ModelFlags(**{"compile": "auto", **kwargs}).checked()


def test_auto_takes_the_stored_step_on_the_cpu_in_one_process_and_runs_eagerly_elsewhere():
    plan = plan_run(flags(), facts())
    assert (plan.step, plan.compiled_layers, plan.strict) == ("stored", True, False)
    assert plan_run(flags(), facts(world_size=2)).step == "eager"
    assert plan_run(flags(), facts(device=CUDA, stored_step=False, dtype=torch.bfloat16)).step == "eager"
    assert plan_run(flags(), facts(stored_step=False)).step == "eager"  # no packages here: nothing compiled
    assert plan_run(flags(compile=False), facts()).step == "eager"
    old_torch = replace(facts(stored_step=False), stored_step_note="the stored compiled step needs torch 2.13")
    assert plan_run(flags(), old_torch).notes == ("the stored compiled step needs torch 2.13",)
    assert plan_run(flags(compile=False), old_torch).notes == ()  # compile=False hides it


def test_compile_true_compiles_every_step_and_is_refused_under_torchrun():
    assert plan_run(flags(compile=True), facts()).step == "stored"
    gpu = plan_run(flags(compile=True), facts(device=CUDA, stored_step=False, dtype=torch.bfloat16))
    assert (gpu.step, gpu.strict) == ("torch.compile", True)
    with pytest.raises(LlamaError, match="one process"):
        plan_run(flags(compile=True), facts(world_size=2))


def test_the_servers_batched_step_is_decided_in_the_plan_too():
    """llama-server loads with compile=False and `compile_layers`: the plan says how its batched step runs, and the
    server's runner asks nothing again."""
    def server(layers, **machine):
        return plan_run(flags(compile=False, compile_layers=layers), facts(**machine))

    auto = server("auto")
    assert (auto.batched_step, auto.batched_strict, auto.step, auto.compiled_layers) == ("stored", False, "eager", True)
    assert "stored compiled batched step" in auto.describe()
    assert server("auto", stored_step=False).batched_step == "eager"  # no packages here: the eager step serves
    assert server("auto", world_size=2).batched_step == "eager"
    gpu = server(True, device=CUDA, stored_step=False, dtype=torch.bfloat16)
    assert (gpu.batched_step, gpu.batched_strict) == ("torch.compile", True)
    assert server(False).batched_step == plan_run(flags(), facts()).batched_step == "eager"  # the commands' own
    with pytest.raises(LlamaError, match="one process"):
        server(True, world_size=2)
    old_torch = replace(facts(stored_step=False), stored_step_note="the stored compiled step needs torch 2.13")
    assert plan_run(flags(compile=False, compile_layers="auto"), old_torch).notes == (old_torch.stored_step_note,)


def test_a_cache_in_another_dtype_without_stored_steps_runs_eagerly_with_a_note_or_is_refused():
    gpu = facts(device=CUDA, stored_step=False, dtype=torch.bfloat16)
    assert plan_run(flags(kv_cache_dtype="float32"), gpu).notes == ()  # auto compiles nothing on a GPU anyway
    server = plan_run(flags(compile=False, compile_layers="auto", kv_cache_dtype="int8"), facts())
    assert server.compiled_layers and server.kv_cache_dtype == torch.int8  # the stored steps take an int8 cache
    for asked in (dict(compile=True), dict(compile=False, compile_layers=True)):  # asked for, not to be had: refused
        with pytest.raises(LlamaError, match="kv_cache_dtype=float32"):
            plan_run(flags(kv_cache_dtype="float32", **asked), gpu)
    plan = plan_run(flags(kv_cache_dtype="int8"), facts(stored_step=False))  # auto, no packages (LLAMA_COMPILE_AOT=0)
    assert plan.step == "eager" and not plan.compiled_layers
    assert "kv_cache_dtype=int8 the decode step runs eagerly" in plan.notes[-1]


def test_quantized_layers_take_the_integer_kernels_only_on_the_cpu_where_they_load():
    assert plan_run(flags(), facts(quant=INT8)).integer
    assert plan_run(flags(), facts(quant=INT8)).needs_kernels
    assert not plan_run(flags(quant_kernels="exact"), facts(quant=INT8)).integer
    assert not plan_run(flags(), facts(device=CUDA, stored_step=False, quant=INT8, dtype=torch.bfloat16)).integer
    missing = plan_run(flags(), facts(quant=INT8, kernels=Kernels(), missing="no C++ compiler"))
    assert not missing.integer and "no C++ compiler" in missing.notes[-1]
    assert not plan_run(flags(compile=False), facts()).needs_kernels  # a float eager run needs none of ours


def test_an_int8_cache_makes_float32_products_row_exact_where_the_kernels_are():
    assert plan_run(flags(kv_cache_dtype="int8"), facts()).row_exact_float
    assert not plan_run(flags(kv_cache_dtype="int8"), facts(kernels=Kernels())).row_exact_float
    assert not plan_run(flags(kv_cache_dtype="int8"), facts(dtype=torch.bfloat16)).row_exact_float
    assert not plan_run(flags(), facts()).row_exact_float


def test_decode_threads_follow_their_cores_only_where_the_kernels_carry_every_step():
    """On the CPU kernels no row depends on the thread count; torch's own attention sums by threads."""
    assert plan_run(flags(), facts()).adapt_threads  # the default mode
    assert plan_run(flags(), facts(quant=INT8)).adapt_threads
    assert plan_run(flags(compile=False, kv_cache_dtype="int8"), facts()).adapt_threads  # row-exact products
    assert not plan_run(flags(compile=False), facts()).adapt_threads  # the eager reference: torch's products
    assert not plan_run(flags(), facts(kernels=Kernels())).adapt_threads
    assert not plan_run(flags(), facts(dtype=torch.bfloat16)).adapt_threads
    assert not plan_run(flags(), facts(world_size=2)).adapt_threads
    assert not plan_run(flags(), facts(device=CUDA, stored_step=False)).adapt_threads


@pytest.mark.parametrize("bad, message", [(dict(quant_kernels="fast"), "quant_kernels=fast"),
                                          (dict(kv_cache_dtype="int4"), "kv_cache_dtype=int4"),
                                          (dict(compile="yes"), "compile must be"),
                                          (dict(quantize="int3"), "int3")])
def test_flags_out_of_their_choices_are_refused_before_anything_loads(bad, message):
    with pytest.raises(LlamaError, match=message):
        ModelFlags(**bad).checked()


def test_build_carries_the_plan_out(gqa_ckpt):
    llama = Llama.build(gqa_ckpt, max_seq_len=32, max_batch_size=1, device="cpu", quantize="int8",
                        kv_cache_dtype="int8", compile=False)
    plan = llama.info.plan
    assert (plan.step, plan.kv_cache_dtype, plan.quantization) == ("eager", torch.int8, "int8")
    assert llama.compiled_step is None and llama.model.kv_cache_dtype == torch.int8
    assert llama.info.quant_kernels == ("integer" if plan.integer else "exact")
    assert plan.describe().startswith("cpu, float32 (int8 KV cache), int8 on the ")
