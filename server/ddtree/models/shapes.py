"""Random-weight models of published shapes: their configs and the builders that make them on the device in the
model's dtype. Benchmarks measure them (`ddtree bench --shape`) and the server serves them (`ddtree serve
--shape`), so a GPU can be measured at the size of a model no one has downloaded."""


from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ddtree.errors import DDTreeError
from ddtree.models.draft import DFlashDraft
from ddtree.models.fp8_target import quantize_target
from ddtree.models.quantize import check_device, check_format
from ddtree.models.target import HybridTarget, Target


def hybrid_shape(target: dict, draft: dict) -> dict:
    """A Qwen3.5/3.6-style shape: three Gated DeltaNet layers then one gated attention layer, repeated; partial
    RoPE. Its DFlash draft (Qwen3.6-27B-DFlash's layout unless `draft` says otherwise) keeps a 2048-token
    sliding window in every layer but the last."""
    vocab, layers, draft_layers = target["vocab_size"], target["num_hidden_layers"], draft["num_layers"]
    return dict(
        target=dict(target, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
                    linear_conv_kernel_dim=4, max_position_embeddings=262144, initializer_range=0.02,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}),
        draft=dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, mask_token_id=vocab - 2,
                   rope_theta=1e7, max_position_embeddings=262144, sliding_window=2048,
                   layer_types=["sliding_attention"] * (draft_layers - 1) + ["full_attention"]) | draft)


SHAPES = {
    "qwen3-8b": dict(
        target=dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False),
        draft=dict(num_layers=5, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=12288,
                   block_size=16, mask_token_id=151669, target_layer_ids=[1, 9, 17, 25, 33], rope_theta=1e6)),
    # Qwen3.6-27B text stack: 64 layers = 48 Gated DeltaNet + 16 gated attention (every 4th).
    "qwen3.6-27b": hybrid_shape(
        target=dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                    num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                    linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128),
        draft=dict(num_layers=5, intermediate_size=17408, target_layer_ids=[1, 16, 31, 46, 61])),
    # Qwen3-Coder-30B-A3B (128 experts, 8 per token). Its DFlash draft's config is not in our references: this
    # one takes the 8B draft's layout at the target's width.
    "qwen3-30b-a3b": dict(
        target=dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                    num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=262144,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e7}, tie_word_embeddings=False,
                    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
        draft=dict(num_layers=5, num_heads=32, num_kv_heads=4, head_dim=128, intermediate_size=6144,
                   block_size=16, mask_token_id=151669, target_layer_ids=[1, 12, 23, 34, 45], rope_theta=1e7)),
    # The tiny shapes run anywhere in seconds: for smoke tests of the suite and the server. Their vocabulary is the
    # demo tokenizer's, so `ddtree serve --shape tiny` takes text.
    "tiny": dict(
        target=dict(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e4}, tie_word_embeddings=False),
        draft=dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, block_size=8,
                   mask_token_id=8191, target_layer_ids=[1, 2], rope_theta=1e4)),
    "tiny-moe": dict(
        target=dict(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e4}, tie_word_embeddings=False,
                    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
        draft=dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, block_size=8,
                   mask_token_id=8191, target_layer_ids=[1, 2], rope_theta=1e4)),
    "tiny-hybrid": hybrid_shape(
        target=dict(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16),
        draft=dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, block_size=8,
                   target_layer_ids=[1, 2])),
}


def build_target(shape: dict, device: torch.device, dtype: torch.dtype, quantization: str | None = None) -> Target:
    """The random-weight target of a shape, its weights born in `dtype` on `device` (a 27B model never
    exists in fp32); a HybridTarget when the shape has linear-attention layers, a Qwen3-MoE model when it
    has experts. `quantization` "fp8": its projections in the FP8 checkpoints' 128 x 128 blocks."""
    import transformers

    hybrid = "linear_attention" in shape["target"].get("layer_types", ())
    family = "Qwen3_5" if hybrid else "Qwen3Moe" if "num_experts" in shape["target"] else "Qwen3"
    config = getattr(transformers, f"{family}TextConfig" if hybrid else f"{family}Config")(**shape["target"])
    with born(device, dtype):
        model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    if check_format(quantization, "target quantization"):
        check_device(device, "an fp8 target")
        quantize_target(model, device, blocks=True)
    target = HybridTarget(model) if hybrid else Target(model)
    target.quantization = "fp8 (128 x 128 block scales, random)" if quantization == "fp8" else None
    return target


def build_draft(shape: dict, target: Target, device: torch.device, dtype: torch.dtype) -> DFlashDraft:
    """The random-weight DFlash draft of a shape, for `target`, born in `dtype` on `device`."""
    from ddtree.models.draft import draft_config_dict, parse_draft_config

    t = shape["target"]
    cfg = draft_config_dict(hidden_size=t["hidden_size"], vocab_size=t["vocab_size"],
                            num_target_layers=t["num_hidden_layers"], **shape["draft"])
    with born(device, dtype):
        draft = DFlashDraft(parse_draft_config(cfg, target.shape))
    return draft.place(device, dtype).eval()  # RoPE frequencies in fp32


def check_shape(name: str) -> dict:
    """The shape called `name`, or a one-line error that lists them."""
    if name not in SHAPES:
        raise DDTreeError(f"unknown shape {name!r}; choose one of {', '.join(SHAPES)}")
    return SHAPES[name]


def build_models(name: str, device: torch.device, dtype: torch.dtype,
                 quantization: str | None = None) -> tuple[Target, DFlashDraft]:
    """The shape's random-weight target and drafter, seeded: every process, benchmark or server, builds the same
    weights, so runs of one shape compare alike."""
    shape = check_shape(name)
    torch.manual_seed(0)
    target = build_target(shape, device, dtype, quantization)
    return target, build_draft(shape, target, device, dtype)


@contextlib.contextmanager
def born(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Create tensors on `device` in `dtype` inside the block; torch's default dtype is restored after."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(default)


class ShapeTokenizer:
    """A tokenizer for a shape with more token ids than it has (the demo's 8192 for Qwen3-8B's 151,936): an id beyond
    it decodes as that id modulo its size. Every generated token is then text, as with a model's own tokenizer;
    ids that decoded to nothing would hold a stream's first chunk back and count as time to the first token."""

    def __init__(self, tokenizer: Any) -> None:
        self.inner = tokenizer

    @property
    def text_encoder(self) -> Any:
        """What turns text into ids: the wrapped tokenizer itself (only decoding differs), so the front end's
        tokenization cache (api/prompt_tokens.py) can recognise it."""
        return self.inner

    def decode(self, ids: Sequence[int], **options: Any) -> str:
        size = len(self.inner)
        return self.inner.decode([i % size for i in ids], **options)

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:  # everything else is the tokenizer's own
        if name == "inner":  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.inner, name)
