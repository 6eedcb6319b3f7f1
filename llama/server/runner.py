"""One step of the model for many rows at once: feed each row's tokens at its positions, sample its next token.

The runner owns the model and the paged KV cache's tensors and knows nothing of requests: a row is token
ids, the position of the first, the blocks that hold the row's keys and values, and how to sample. Rows
feeding one token each (the decoding sequences) run as one batch, each at its own position; a row
feeding a chunk of a prompt runs on its own. A row with a draft (speculative decoding) feeds its newest token and
each drafted token as rows of that batch, at consecutive positions through the same blocks: every layer writes the
whole batch's keys and values before any row reads them, so each drafted position sees the ones before it, and its
logits are those of the plain step that would feed it. Without a KV cache each row feeds its whole prefix from
position 0 through the model's plain path, as `Llama.generate(kv_cache=False)` does.
"""

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from llama.compile.step import Step, compile_paged_step
from llama.constraint import Constraint
from llama.sampling import SamplingControls, apply_controls, check_draft, check_finite, sample
from llama.model import Transformer
from llama.run_plan import RunPlan
from llama.runtime.progress import Progress


@dataclass
class Sampler:
    """How a row's next token is chosen: `generation.sample` with its own generator, and what to report."""

    temperature: float
    top_p: float
    generator: torch.Generator
    top_logprobs: Optional[int] = None  # None: no log-probabilities; k: the chosen token's and the k likeliest
    controls: Optional[SamplingControls] = None  # penalties, biases, top-k, min-p (llama/sampling.py); None: none
    prompt_len: int = 0  # how many of a row's `history` are its prompt (the penalties count what follows)
    constraint: Optional[Constraint] = None  # a grammar the generated tokens keep to (llama/constraint.py); None: none


@dataclass
class Row:
    """Tokens fed at positions start .. start + len(tokens) - 1, reading and writing through `blocks`."""

    tokens: List[int]
    start: int
    blocks: List[int] = field(default_factory=list)
    # Tokens to score: the one after each fed token, where known (a prompt's); their log-probabilities are reported.
    scored: List[int] = field(default_factory=list)
    scored_top: int = 0  # and the likeliest this many alternatives at each
    sampler: Optional[Sampler] = None  # None: nothing is sampled from this row
    draft: List[int] = field(default_factory=list)  # tokens to check after the one token fed, at the next positions
    # Every token of the sequence up to the last one fed, where the sampler has controls or a constraint that read them.
    history: List[int] = field(default_factory=list)

    @property
    def all_logits(self) -> bool:
        return bool(self.scored)


@dataclass
class Result:
    # The tokens sampled: one; or after a draft, the drafted tokens kept and the model's own after them.
    tokens: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)  # each one's log-probability, where the sampler asks
    tops: List[List[Tuple[int, float]]] = field(default_factory=list)  # and the likeliest alternatives at each
    # For each scored token: its log-probability and the likeliest alternatives at its position.
    fed_logprobs: List[Tuple[float, List[Tuple[int, float]]]] = field(default_factory=list)


class Runner:
    """Batched forward steps of one model over a paged KV cache.

    The runner takes the model over: with a compiled step its float weights become row-major, and eagerly its
    output matrix gains a row-major copy for many rows (`_ManyRowsOutput`).

    Args:
        model: the model, built and loaded; for a compiled step, loaded with its layers planned for it
            (`Llama.build(compile_layers=...)`), which its eager steps run too.
        num_blocks, block_size: the KV cache's blocks; num_blocks 0 runs without a cache.
        plan: the model's run plan (`Llama.info.plan`, llama/run_plan.py), whose `batched_step` says how the decode
            step runs: "stored" loads it from stored packages (llama/compile/aot.py's PagedStep, built first where there
            are none), "torch.compile" compiles it now, "eager" (or no plan) runs the model's own step.
        max_rows: the most rows a decode step feeds (llama-server --parallel): the packages for up to that many
            are ready before serving.
        progress: told about package builds.

    Raises:
        LlamaError: the plan's `batched_strict` (compile_layers=True), and the step could not be compiled.
    """

    def __init__(self, model: Transformer, num_blocks: int, block_size: int, plan: Optional[RunPlan] = None,
                 max_rows: int = 16, progress: Optional[Progress] = None):
        self.model = model
        self.device = model.device
        self.cache = model.new_paged_kv_cache(num_blocks, block_size) if num_blocks > 0 else None
        self.notes: List[str] = []  # what the user should hear about the compiled step
        self.compiled_step: Optional[Step] = None  # the decode step (llama/compile/step.py); None: the model's own
        if plan is not None and plan.batched_step != "eager" and self.cache is not None:
            self.compiled_step, self.notes = compile_paged_step(model, self.cache, plan.batched_step,
                                                                plan.batched_strict, max_rows, progress)
        if self.compiled_step is None and _ManyRowsOutput.suits(model.output):
            model.output = _ManyRowsOutput(model.output)

    def close(self) -> None:
        """Once the engine has stopped: nothing to release in one process (llama/server/ranks.py's runner tells
        the other ranks to exit)."""

    @torch.inference_mode()
    def block_tensor(self, block: int) -> torch.Tensor:
        """A copy of one block's keys and values in every layer, on the CPU (to keep on disk)."""
        return self.cache.block_tensor(block).cpu()

    @torch.inference_mode()
    def load_blocks(self, loads: Sequence[Tuple[int, torch.Tensor]]) -> None:
        """Write each (block, keys and values) into the cache, as `block_tensor` gave them."""
        for block, kv in loads:
            self.cache.load_block(block, kv.to(self.device))

    @torch.inference_mode()
    def step(self, copies: Sequence[Tuple[int, int, int]], rows: Sequence[Row]) -> List[Result]:
        """Copy block prefixes, then feed every row; returns one result per row, in order.

        Raises:
            LlamaError: the model produced NaN or infinite logits.
        """
        for src, dst, n in copies:
            self.cache.copy_prefix(src, dst, n)
        results: List[Optional[Result]] = [None] * len(rows)
        if self.cache is None:
            for i, row in enumerate(rows):
                tokens = torch.tensor([row.tokens], device=self.device)
                results[i] = self._finish(row, self.model(tokens, 0, None, num_logits=None if row.all_logits else 1)[0])
            return results
        single = [i for i, row in enumerate(rows) if len(row.tokens) == 1 and not row.all_logits]
        if single:
            # A draft's tokens are rows of their own, each at its position: (row, its first row in the batch).
            batch: List[Row] = []
            first = []
            for i in single:
                row = rows[i]
                first.append(len(batch))
                batch += [Row([t], row.start + j, row.blocks) for j, t in enumerate(row.tokens + row.draft)]
            logits = self._forward(batch)[:, -1]  # (len(batch), vocab)
            for j, i in zip(first, single):
                results[i] = self._finish(rows[i], logits[j : j + 1 + len(rows[i].draft)])
        for i, row in enumerate(rows):
            if results[i] is None:
                results[i] = self._finish(row, self._forward([row])[0])
        return results

    def _forward(self, rows: Sequence[Row]) -> torch.Tensor:
        """Logits of rows that feed the same number of tokens, each at its positions: (len(rows), n, vocab),
        or only the last position's when no row wants them all."""
        n = len(rows[0].tokens)
        all_logits = any(row.all_logits for row in rows)
        # Prompt chunks run eagerly, as llama/compile/step.py runs prompts: their lengths vary too much to compile.
        compiled = self.compiled_step is not None and n == 1 and not all_logits
        # A compiled step would specialise on a table one block wide: pad to two (the padding is masked).
        width = max([len(row.blocks) for row in rows] + [2 if compiled else 1])
        if not compiled:
            # Only the blocks up to the rows' last position: a prompt's chunk holds the whole prompt's blocks, and
            # attending over the columns the mask hides would cost as much as over those it shows.
            width = min(width, -(-max(row.start + n for row in rows) // self.cache.block_size))
        tables = torch.tensor([(row.blocks + [row.blocks[0]] * (width - len(row.blocks)))[:width] for row in rows],
                              device=self.device)
        tokens = torch.tensor([row.tokens for row in rows], device=self.device)
        input_pos = torch.tensor([[row.start + k for k in range(n)] for row in rows], device=self.device)
        if compiled:
            return self.compiled_step.paged(tokens, input_pos, tables)
        caches = self.cache.for_step(tables, input_pos)
        return self.model(tokens, cache=caches, input_pos=input_pos, num_logits=None if all_logits else 1)

    def _finish(self, row: Row, logits: torch.Tensor) -> Result:
        """Sample from a row's last logits, and the log-probabilities asked for. `logits`: (positions, vocab)."""
        result = Result()
        if row.all_logits:
            logprobs = torch.log_softmax(logits[: len(row.scored)], dim=-1)
            targets = torch.tensor(row.scored, device=self.device)
            chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
            tops = _top(logprobs, row.scored_top) if row.scored_top else [[] for _ in chosen]
            result.fed_logprobs = list(zip(chosen, tops))
        sampler = row.sampler
        if sampler is None:
            return result
        last = logits[-1 - len(row.draft) :]  # the newest token's logits, and each drafted one's
        check_finite(last, row.start + len(row.tokens) - 1)
        # The log-probabilities reported stay the model's; the token is chosen from the masked, controlled logits.
        chosen_from = last
        if sampler.constraint is not None:  # the engine drafts nothing for a constrained row
            assert not row.draft, "a constrained row has no draft"
            chosen_from = sampler.constraint.mask(last[0], row.history[sampler.prompt_len :])[None]
        if sampler.controls is not None:
            # Each drafted position's tokens so far are the history and the drafted ones before it, as the plain
            # decode would have them there.
            chosen_from = torch.stack([apply_controls(chosen_from[i], sampler.controls, row.history + row.draft[:i],
                                                      sampler.prompt_len) for i in range(last.shape[0])])
        if row.draft:
            result.tokens = check_draft(chosen_from, row.draft, sampler.temperature, sampler.top_p, sampler.generator)
        else:
            result.tokens = [int(sample(chosen_from, sampler.temperature, sampler.top_p, sampler.generator)[0])]
        if sampler.top_logprobs is not None:
            logprobs = torch.log_softmax(last[: len(result.tokens)], dim=-1)
            result.logprobs = logprobs.gather(1, torch.tensor(result.tokens, device=logprobs.device)[:, None])[:, 0].tolist()
            result.tops = _top(logprobs, sampler.top_logprobs) if sampler.top_logprobs else [[] for _ in result.tokens]
        return result


class _ManyRowsOutput(nn.Module):
    """The output matrix laid out twice: as loaded for one row, and row-major for the server's many rows.

    The model stores its wide matrices input-major, where MKL's one-row product is fastest; for 2-16 rows MKL's
    `F.linear` on that layout is several times slower than `torch.mm(W, x.T)` on a row-major copy (the figures:
    docs/benchmarks.md, "Figures behind the code"). The output matrix, the widest, is the one where this shows, and it
    costs one more copy of it. Same weights, same state_dict; logits within float rounding.
    """

    def __init__(self, layer: nn.Linear):
        super().__init__()
        self.weight = layer.weight
        self.register_buffer("row_major", layer.weight.detach().contiguous(), persistent=False)
        self._forward_hooks.update(layer._forward_hooks)  # under torchrun: the gather of the vocabulary's slices

    @staticmethod
    def suits(layer: nn.Module) -> bool:
        """A float32 nn.Linear on the CPU, stored input-major (the eager one-row layout)."""
        return (type(layer) is nn.Linear and layer.weight.device.type == "cpu" and layer.weight.dtype == torch.float32
                and not layer.weight.is_contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # (rows, dim)
        if rows.shape[0] == 1:
            return F.linear(x, self.weight)
        return torch.mm(self.row_major, rows.t()).t().reshape(*x.shape[:-1], -1)  # (..., vocab)


def _top(logprobs: torch.Tensor, k: int) -> List[List[Tuple[int, float]]]:
    """The k likeliest tokens at each position of (positions, vocab) log-probabilities."""
    values, ids = torch.topk(logprobs, k, dim=-1)
    return [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
