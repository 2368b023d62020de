"""Our wgmma GEMM (ddtree/kernels/wgmma.py) against cuBLASLt at a tree verify's rows, projection by projection.

Every config's output is first checked against torch's (float32 reference: the same size of error as cuBLAS's
bf16 product, and the same bits on a second run). Each timing is a CUDA graph of 36 calls cycling over distinct
weights (ddtree.bench.command.cycled_us): ours launch as programmatic dependents of each other, so a call's first
weight tiles load while the call before it drains; cuBLASLt's do not. `--chain` puts a row kernel (a residual
add + RMSNorm, ddtree/kernels/rows.py) in front of every call, as in a verify's layers. `--glu` times a layer's
MLP instead: the gate/up product, then the SiLU · up row kernel, against SiLU · up in the product's epilogue
(Config.glu), alone and with the down projection after it.

    PYTHONPATH=server python benchmarks/wgmma_tune.py [--rows 65 33 129] [--only qkv o] [--grid] [--chain]
    PYTHONPATH=server python benchmarks/wgmma_tune.py --glu [--rows 33 65]
"""

from __future__ import annotations

import argparse
import itertools

import torch
from ddtree.bench.timing import cycled_us, weight_copies
from ddtree.kernels import wgmma
from ddtree.kernels.gemm import linear

SHAPES = {"qkv": (6144, 4096, 36), "o": (4096, 4096, 36), "gate_up": (24576, 4096, 36), "down": (4096, 12288, 36),
          "lm_head": (151936, 4096, 1)}


def grid(n: int, k: int, rows: int) -> list[wgmma.Config]:
    """The default config first, then every (warpgroups, splits) whose blocks make one to two waves."""
    default = wgmma.launch_config(n, k, rows)
    configs = [default]
    bn = wgmma.padded_rows(rows)
    for consumers, splits in itertools.product((1, 2, 3), (1, 2, 4, 8)):
        blocks = -(-n // (64 * consumers)) * splits
        if blocks <= 2 * 132 and (k // 64) % splits == 0:
            for evict_first in (True, False):
                cfg = wgmma.Config(consumers, bn, wgmma.max_stages(consumers, bn), splits, evict_first)
                if cfg not in configs:
                    configs.append(cfg)
    return configs


def check(x: torch.Tensor, w: torch.Tensor, cfg: wgmma.Config) -> str | None:
    """None when the config's product is as close to float32's as cuBLAS's and repeats bit for bit; else why not."""
    exact = x.float() @ w.float().T
    ours, again, blas = wgmma.linear(x, w, cfg), wgmma.linear(x, w, cfg), torch.nn.functional.linear(x, w)
    err, blas_err = (ours.float() - exact).abs().max().item(), (blas.float() - exact).abs().max().item()
    if not torch.equal(ours, again):
        return "differs between two runs"
    if err > 2 * blas_err + 1e-3:
        return f"max error {err:.3g} against cuBLAS's {blas_err:.3g}"
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="*", default=[65, 33, 129])
    ap.add_argument("--only", nargs="*", help="these projections only")
    ap.add_argument("--grid", action="store_true", help="time a grid of configs, not only the default")
    ap.add_argument("--chain", action="store_true", help="a residual add + RMSNorm kernel before every call")
    ap.add_argument("--glu", action="store_true", help="SiLU · up in the gate/up product's epilogue, or after it")
    args = ap.parse_args()
    if args.glu:
        for rows in args.rows:
            mlp_probe(rows)
        return
    shapes = {name: s for name, s in SHAPES.items() if not args.only or name in args.only}
    print("| proj | rows | variant | µs |\n|---|---|---|---|")
    for rows in args.rows:
        totals = [0.0, 0.0]
        for name, (n, k, calls) in shapes.items():
            for i, us in enumerate(probe(name, n, k, rows, args.grid, args.chain)):
                totals[i] += calls * us
        print(f"\n{rows} rows, {' + '.join(shapes)}: cuBLASLt {totals[0] / 1e3:.3f} ms, "
              f"wgmma {totals[1] / 1e3:.3f} ms\n", flush=True)


def probe(name: str, n: int, k: int, rows: int, full_grid: bool, chain: bool) -> tuple[float, float]:
    """Print one projection's lines; returns µs per call of (cuBLASLt, the fastest right config)."""
    weights = weight_copies(n, k)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    before = _row_kernel(x) if chain else (lambda: x)
    wgmma.ENABLED = False  # `gemm.linear` as before the kernel: cuBLASLt for 33-128 rows
    blas = cycled_us(lambda w: linear(before(), w), weights)
    wgmma.ENABLED = True
    print(f"| {name} | {rows} | cuBLASLt (`gemm.linear`) | {blas:.1f} |", flush=True)
    best = float("nan")
    for cfg in grid(n, k, rows) if full_grid else grid(n, k, rows)[:1]:
        wrong = check(x, weights[0], cfg)
        if wrong:
            print(f"| {name} | {rows} | {cfg} | WRONG: {wrong} |", flush=True)
            continue
        us = cycled_us(lambda w, cfg=cfg: wgmma.linear(before(), w, cfg), weights)
        best = us if not best <= us else best
        print(f"| {name} | {rows} | {cfg} | {us:.1f} |", flush=True)
    weights.clear()
    torch.cuda.empty_cache()
    return blas, best


def mlp_probe(rows: int) -> None:
    """The 8B MLP at `rows` rows: SiLU · up after the gate/up product or in its epilogue, alone and then down (µs a
    layer, 36 layers cycling over distinct weights); the two activations are checked equal first."""
    from ddtree.kernels.rows import silu_mul

    (n, k, _), (down_n, down_k, _) = SHAPES["gate_up"], SHAPES["down"]
    # as many layers as there are gate/up copies (the wider weight: fewer fit the 2 GiB)
    layers = list(zip(weight_copies(n, k), weight_copies(down_n, down_k), strict=False))
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)

    def plain(layer: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return silu_mul(wgmma.linear(x, layer[0]))

    def folded(layer: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return wgmma.silu_mul_linear(x, layer[0])

    if not torch.equal(plain(layers[0]), folded(layers[0])):
        print(f"| MLP | {rows} | the epilogue's SiLU · up | WRONG: not the row kernel's bits |")
        return
    for label, act in (("gate/up, then the SiLU · up kernel", plain), ("SiLU · up in the epilogue", folded)):
        print(f"| MLP | {rows} | {label} | {cycled_us(act, layers):.1f} |", flush=True)
        print(f"| MLP | {rows} | {label}, then down | {cycled_us(lambda w, a=act: linear(a(w), w[1]), layers):.1f} |",
              flush=True)
    layers.clear()
    torch.cuda.empty_cache()


def _row_kernel(x: torch.Tensor):
    """A residual add + RMSNorm over x's rows (the Triton row kernel a verify runs before q/k/v and gate/up)."""
    from ddtree.kernels.rows import add_rms_norm

    residual, weight = torch.randn_like(x), torch.ones(x.shape[1], device=x.device, dtype=x.dtype)
    return lambda: add_rms_norm(x, residual, weight, 1e-6)[0]


if __name__ == "__main__":
    main()
