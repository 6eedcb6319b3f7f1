"""Time each candidate for a quantized linear layer at one row of activations (a decode step), 2 threads.

    python scripts/bench_quant_kernels.py 1536x576 576x1536 49152x576     # the default model's shapes
    python scripts/bench_quant_kernels.py 11008x4096 4096x11008           # 7B's feed-forward

For each OUTxIN weight: float32 F.linear (as stored and input-major), torch's private int8 and int4 kernels
with float32 and bf16 activations, dequantize-then-F.linear, and the compiled reductions of
llama/quant/quantize.py (int8, int4 by group size) and llama/compile/step.py (float32). Prints microseconds per call
and the weight bytes read per second. Take figures on a quiet machine: under load, two-thread kernels
wait on each other's time slices and read 10-100x slow.
"""
import time, sys, torch, torch.nn.functional as F
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parent.parent))
from llama.quant import format as qf
from llama.quant.quantize import Int4Linear, Int8Linear
torch.set_num_threads(2)

def bench(fn, n=None, t=0.5):
    fn(); fn()
    n = 0; s = time.perf_counter()
    while time.perf_counter() - s < t:
        fn(); n += 1
    return (time.perf_counter() - s) / n

def run(out_f, in_f, gs=32):
    w = torch.randn(out_f, in_f) * 0.02
    x = torch.randn(1, in_f)
    xb = x.bfloat16()
    res = {}
    res['fp32 F.linear'] = bench(lambda: F.linear(x, w))
    wt = w.t().contiguous().t()
    res['fp32 F.linear colmajor'] = bench(lambda: F.linear(x, wt))
    q8, s8 = qf.quantize_int8(w)
    s8f = s8.float().reshape(-1)
    res['int8pack_mm fp32x'] = bench(lambda: torch.ops.aten._weight_int8pack_mm(x, q8, s8f))
    res['int8pack_mm bf16x'] = bench(lambda: torch.ops.aten._weight_int8pack_mm(xb, q8, s8f.bfloat16()))
    res['int8 dequant+linear'] = bench(lambda: F.linear(x, q8.float() * s8f[:, None]))
    for g in [g for g in (32, 64, 128) if in_f % g == 0]:
        p, s, m = qf.quantize_int4(w, g)
        q = qf.unpack_int4(p).to(torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        sz = torch.stack([s.float(), m.float() + 8 * s.float()], -1).transpose(0, 1).contiguous()  # (G, out, 2)
        res[f'int4pack_mm g{g} bf16x'] = bench(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, g, sz.bfloat16()))
        if g == 32:
            res[f'int4pack_mm g{g} fp32x'] = bench(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, g, sz), t=0.2)
            res['int4 dequant+linear g32'] = bench(lambda: F.linear(x, qf.dequantize(p, s, m)), t=0.2)
            # check kernel correctness
            ref = F.linear(x, qf.dequantize(p, s, m))
            got = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, g, sz.bfloat16()).float()
            got32 = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, g, sz)
            print('  int4 err bf16', (got - ref).abs().max().item(), 'fp32', (got32 - ref).abs().max().item(), 'ref max', ref.abs().max().item())
        # the compiled reduction llama/quant/quantize.py ships (halves layout, dequantized in registers)
        layer4 = Int4Linear(in_f, out_f, g)
        layer4.weight, layer4.scales, layer4.mins = p, s, m
        layer4.use_halves_layout()
        c4 = torch.compile(layer4._reduction, fullgraph=True)
        ref = F.linear(x, qf.dequantize(p, s, m))
        got = c4(x)
        res[f'int4 compiled reduction g{g}'] = bench(lambda: c4(x))
        print(f'  reduction int4 g{g} err', (got - ref).abs().max().item())
    layer8 = Int8Linear(in_f, out_f)
    layer8.weight, layer8.scales = q8, s8
    c8 = torch.compile(layer8._reduction, fullgraph=True)
    res['int8 compiled reduction'] = bench(lambda: c8(x))
    def redf(x, w):
        return (x.unsqueeze(-2) * w).sum(-1)
    cf = torch.compile(redf, fullgraph=True)
    res['fp32 compiled reduction'] = bench(lambda: cf(x, w))
    wbytes = {'fp32': 4, 'int8': 1, 'int4': 0.5}
    print(f'{out_f}x{in_f}:')
    for k, v in res.items():
        b = out_f * in_f * wbytes[k.split()[0][:4]]
        print(f'  {k:32s} {v*1e6:9.1f} us  {b / v / 1e9:6.1f} GB/s(weights)')

for shape in [tuple(map(int, s.split('x'))) for s in sys.argv[1:]]:
    run(*shape)
