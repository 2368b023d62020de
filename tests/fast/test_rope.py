"""The fast path's rotary table (ddtree/fast/rope.py) gives the model's own rotary module's cos and sin, bit for
bit, at every position a forward can ask for; a length-dependent rotary type keeps calling the module."""

from __future__ import annotations

import pytest
import torch
from ddtree.fast.rope import RopeTable
from transformers import LlamaConfig, Qwen3_5TextConfig, Qwen3Config, Qwen3NextConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding

from tests.tiny import hybrid_text_config

SIZE = 1536  # the table's positions
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
ROTARIES = {
    "qwen3": lambda: Qwen3RotaryEmbedding(Qwen3Config(head_dim=128, rope_parameters={
        "rope_type": "default", "rope_theta": 1000000.0})),
    "llama3": lambda: LlamaRotaryEmbedding(LlamaConfig(head_dim=64, rope_parameters=LLAMA3)),
    "yarn": lambda: Qwen3RotaryEmbedding(Qwen3Config(head_dim=64, max_position_embeddings=4096, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024})),
    "qwen3_5 (M-RoPE, partial)": lambda: Qwen3_5TextRotaryEmbedding(Qwen3_5TextConfig(**hybrid_text_config())),
    "qwen3_next (partial)": lambda: Qwen3NextRotaryEmbedding(Qwen3NextConfig(**hybrid_text_config("qwen3_next"))),
}


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


def module_rows(rotary: torch.nn.Module, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """What the fast path computed before the table: the module on [1, n] positions (three rows for M-RoPE)."""
    rows = positions[None]
    if hasattr(rotary, "mrope_section"):
        rows = positions.view(1, 1, -1).expand(3, 1, -1)
    x = torch.zeros(1, positions.numel(), 8, dtype=dtype, device=positions.device)
    return tuple(t[0] for t in rotary(x, rows))


@pytest.mark.parametrize("name", list(ROTARIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", DEVICES)
def test_the_table_gives_the_modules_bits_at_every_position(name, dtype, device):
    rotary = ROTARIES[name]().to(device)
    table = RopeTable(rotary, SIZE, dtype, torch.device(device))
    assert table.table is not None
    everywhere = torch.arange(SIZE, device=device)
    scattered = torch.tensor([SIZE - 1, 0, 700, 701, 5, 5, 1023], device=device)  # a tree's positions repeat
    for positions in (everywhere, scattered):
        cos, sin = table(positions)
        want_cos, want_sin = module_rows(rotary, positions, dtype)
        assert cos.dtype == want_cos.dtype == dtype
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


def test_a_length_dependent_rotary_type_keeps_calling_its_module():
    rotary = Qwen3RotaryEmbedding(Qwen3Config(head_dim=64, max_position_embeddings=256, rope_parameters={
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}))
    table = RopeTable(rotary, SIZE, torch.float32, torch.device("cpu"))
    assert table.table is None
    positions = torch.tensor([3, 900, 1200])  # past the original 256: dynamic NTK rescales the frequencies
    cos, sin = table(positions)
    want_cos, want_sin = module_rows(rotary, positions, torch.float32)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    # and what it gives differs from the table a static type would hold: the module's scaling is in effect
    static = Qwen3RotaryEmbedding(Qwen3Config(head_dim=64, rope_parameters={"rope_type": "default",
                                                                           "rope_theta": 10000.0}))
    assert not torch.equal(cos, module_rows(static, positions, torch.float32)[0])
