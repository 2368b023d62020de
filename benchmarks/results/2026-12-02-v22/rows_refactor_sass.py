"""v22 review: the row kernels before and after the review's refactor (the fp8 SiLU kernel folded into the row
quantization kernel, SwiGLU's arithmetic shared with the plain SiLU kernel) compiled for sm_90 without a GPU, and
their SASS compared instruction for instruction.

    git show 4a48910:server/ddtree/fast/rows.py > /tmp/old_rows.py
    PYTHONPATH=server python benchmarks/results/2026-12-02-v22/rows_refactor_sass.py /tmp/old_rows.py
"""

import importlib.util
import os
import re
import subprocess
import sys
import tempfile

import triton
from ddtree.fast import rows as new
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def sass(fn, args: dict, consts: dict, warps: int) -> list[str]:
    """The kernel's sm_90 instructions, without addresses."""
    consts = {"PDL": True, **consts}
    source = ASTSource(fn=fn, signature={**args, **{k: "constexpr" for k in consts}}, constexprs=consts)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 3})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        out = subprocess.run([tool, "-sass", cubin.name], capture_output=True, text=True, check=True).stdout
    return [line.split("*/")[1].strip() for line in out.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", line)]


def main() -> int:
    spec = importlib.util.spec_from_file_location("old_rows", sys.argv[1])
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    same_everywhere = True
    for dtype in ("bf16", "fp32"):
        rows_args = {"rows": "i32"}
        for half in (4096, 12288):
            block = triton.next_power_of_2(half)
            warps = min(16, max(4, block // 1024))
            quant = {"X": f"*{dtype}", "Q": "*fp8e4nv", "S": "*fp32", **rows_args, "K": "i32", "stride_x": "i32"}
            silu_fp8 = {"GateUp": f"*{dtype}", "Q": "*fp8e4nv", "S": "*fp32", **rows_args, "half": "i32",
                        "stride_row": "i32"}
            silu = {"GateUp": f"*{dtype}", "Out": f"*{dtype}", "total": "i32", "half": "i32", "stride_row": "i32"}
            pairs = {
                "SiLU · up quantized": (sass(old._silu_fp8_kernel, silu_fp8, dict(BLOCK_R=1, BLOCK=block), warps),
                                        sass(new._quantize_kernel, quant, dict(SILU=True, BLOCK_R=1, BLOCK=block),
                                             warps)),
                "row quantization": (sass(old._quantize_kernel, quant, dict(BLOCK_R=1, BLOCK=block), warps),
                                     sass(new._quantize_kernel, quant, dict(SILU=False, BLOCK_R=1, BLOCK=block),
                                          warps)),
                "SiLU · up": (sass(old._silu_kernel, silu, dict(BLOCK=2048), 4),
                              sass(new._silu_kernel, silu, dict(BLOCK=2048), 4)),
            }
            for name, (before, after) in pairs.items():
                same = before == after
                same_everywhere &= same
                verdict = "identical" if same else f"different ({len(before)} vs {len(after)} instructions)"
                print(f"{dtype}, width {half}, {name}: SASS {verdict}")
    return 0 if same_everywhere else 1


if __name__ == "__main__":
    sys.exit(main())
