"""Measuring generation with and without the KV cache: per-token latency by position, prefill, memory."""

import resource
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from llama.generation import Llama


@dataclass
class Run:
    """One generation run: a batch of identical prompts, one cache mode, timed step by step."""

    batch_size: int
    kv_cache: bool
    prompt_tokens: int
    max_new_tokens: int
    new_tokens: int = 0  # how many it produced before finishing or running out of time
    prefill_s: float = 0.0  # from the call to the first new token
    step_s: List[float] = field(default_factory=list)  # each later token's latency, in order
    total_s: float = 0.0
    peak_memory_bytes: int = 0
    kv_cache_bytes: int = 0
    out_of_time: bool = False

    def time_to(self, n: int) -> Optional[float]:
        """Seconds from the call until n new tokens existed, or None if the run stopped before."""
        if n > self.new_tokens or n < 1:
            return None
        return self.prefill_s + sum(self.step_s[: n - 1])

    def decode_tokens_per_s(self, n: Optional[int] = None) -> float:
        """Rows times decode steps per second over the first n new tokens (after the first)."""
        steps = self.step_s[: (n or self.new_tokens) - 1]
        return self.batch_size * len(steps) / sum(steps) if steps else 0.0

    def to_dict(self) -> Dict:
        return asdict(self)


class _OutOfTime(Exception):
    pass


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def memory_probe(device: torch.device):
    """A function returning memory in use: on CUDA the peak of allocations since this call (it resets the peak), on
    the CPU the process's resident set now."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return lambda: torch.cuda.max_memory_allocated(device)
    return _rss


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(llama: Llama, prompt: Sequence[int], batch_size: int, max_new_tokens: int, kv_cache: bool,
            deadline: Optional[float] = None) -> Run:
    """Generate max_new_tokens greedily (ignoring stop tokens, so lengths are exact) and time every step.

    Args:
        deadline: a time.perf_counter() value; the run stops at the first step after it.
    """
    run = Run(batch_size, kv_cache, len(prompt), max_new_tokens)
    probe = memory_probe(llama.device)
    peak = probe()
    stamps: List[float] = []

    def on_step(pos, tokens):
        nonlocal peak
        _sync(llama.device)
        stamps.append(time.perf_counter())
        peak = max(peak, probe())
        if deadline is not None and stamps[-1] > deadline and len(stamps) < max_new_tokens:
            raise _OutOfTime

    _sync(llama.device)
    start = time.perf_counter()
    try:
        # ignore_stop: a benchmark wants exact lengths, not an early end of text.
        llama.generate([list(prompt)] * batch_size, max_new_tokens, temperature=0, kv_cache=kv_cache, on_step=on_step,
                       ignore_stop=True)
    except _OutOfTime:
        run.out_of_time = True
    run.new_tokens = len(stamps)
    run.prefill_s = stamps[0] - start if stamps else 0.0
    run.step_s = [b - a for a, b in zip(stamps, stamps[1:])]
    run.total_s = (stamps[-1] if stamps else time.perf_counter()) - start
    run.peak_memory_bytes = peak
    run.kv_cache_bytes = llama.last_kv_cache_bytes
    return run
