"""v22 call 6: each fp8 row kernel (norm, add + norm, SiLU · up) against the plain row kernel, then the
row quantization (the kernel's and torch's): equal scales, and how many e4m3 values differ."""

import torch
from ddtree import quantize
from ddtree.fast import rows

for dtype in (torch.float32, torch.bfloat16):
    for n, width in ((16, 4096), (16, 12288), (300, 4096)):
        gen = torch.Generator().manual_seed(n + width)
        x = (torch.randn(n, width + 64, generator=gen) * 3).to(dtype).cuda()[:, :width]
        delta = (torch.randn(n, width, generator=gen) * 3).to(dtype).cuda()
        weight = (torch.rand(width, generator=gen) + 0.5).to(dtype).cuda()
        gate_up = (torch.randn(n, 2 * width + 64, generator=gen) * 4).to(dtype).cuda()[:, :2 * width]
        cases = {"norm": (rows.rms_norm_fp8(x, None, weight, 1e-6)[0], rows.rms_norm(x, weight, 1e-6)),
                 "add_norm": (rows.rms_norm_fp8(x, delta, weight, 1e-6)[0],
                              rows.add_rms_norm(x, delta, weight, 1e-6)[0]),
                 "silu": (rows.silu_mul_fp8(gate_up), rows.silu_mul(gate_up))}
        for name, (got, plain) in cases.items():
            v1, s1 = rows.quantize(plain)
            v2, s2 = quantize.quantize_rows(plain)
            print(dtype, n, width, name, "scale==kernel", torch.equal(got.scale, s1),
                  "scale==torch", torch.equal(got.scale, s2),
                  "values!=kernel", (got.values.view(torch.uint8) != v1.view(torch.uint8)).sum().item(),
                  "values!=torch", (got.values.view(torch.uint8) != v2.view(torch.uint8)).sum().item(),
                  "kernel!=torch", (v1.view(torch.uint8) != v2.view(torch.uint8)).sum().item(),
                  "max rel scale", ((got.scale - s2).abs() / s2).max().item(), flush=True)
