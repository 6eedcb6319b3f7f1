"""An independent, deliberately naive LLaMA forward pass for tests: Meta's formulas written out again.

Complex-number rotary embeddings, keys and values repeated per query head, an explicit softmax. It shares
no code with `llama.model`, so a mistake made there in both the cached and the uncached path still shows.
"""

import math
from typing import Dict

import torch


def reference_logits(sd: Dict[str, torch.Tensor], params, tokens: torch.Tensor) -> torch.Tensor:
    """(bsz, seqlen, vocab) float64 logits of `tokens` under the weights `sd`."""
    sd = {k: v.double() for k, v in sd.items()}
    n_heads, n_kv = params.n_heads, params.n_kv_heads
    hd = params.dim // n_heads
    bsz, seqlen = tokens.shape

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + params.norm_eps) * w

    freqs = 1.0 / (params.rope_theta ** (torch.arange(0, hd, 2).double() / hd))
    cis = torch.polar(torch.ones(seqlen, hd // 2, dtype=torch.double), torch.outer(torch.arange(seqlen).double(), freqs))

    def rope(x):  # (bsz, seqlen, heads, hd): consecutive pairs are complex numbers
        xc = torch.view_as_complex(x.reshape(*x.shape[:-1], hd // 2, 2).contiguous())
        return torch.view_as_real(xc * cis[None, :, None, :]).flatten(-2)

    h = sd["tok_embeddings.weight"][tokens]
    causal = torch.triu(torch.full((seqlen, seqlen), float("-inf"), dtype=torch.double), 1)
    for i in range(params.n_layers):
        p = f"layers.{i}."
        x = rms(h, sd[p + "attention_norm.weight"])
        q = rope((x @ sd[p + "attention.wq.weight"].T).view(bsz, seqlen, n_heads, hd))
        k = rope((x @ sd[p + "attention.wk.weight"].T).view(bsz, seqlen, n_kv, hd))
        v = (x @ sd[p + "attention.wv.weight"].T).view(bsz, seqlen, n_kv, hd)
        k = k.repeat_interleave(n_heads // n_kv, dim=2)
        v = v.repeat_interleave(n_heads // n_kv, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd) + causal
        out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1), v).reshape(bsz, seqlen, -1)
        h = h + out @ sd[p + "attention.wo.weight"].T
        x = rms(h, sd[p + "ffn_norm.weight"])
        gate = torch.nn.functional.silu(x @ sd[p + "feed_forward.w1.weight"].T)
        h = h + (gate * (x @ sd[p + "feed_forward.w3.weight"].T)) @ sd[p + "feed_forward.w2.weight"].T
    return rms(h, sd["norm.weight"]) @ sd["output.weight"].T
