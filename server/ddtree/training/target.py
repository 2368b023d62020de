"""`ddtree train-target`: a small Qwen3 causal LM trained from scratch on local text (the demo target).

The result is an ordinary transformers checkpoint (config, bf16 safetensors, generation config, tokenizer
with `<|MASK|>`), so the engine, `train-draft` and any transformers tool load it like a hub model.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

from ddtree.errors import DDTreeError
from ddtree.training.common import Budget, adamw, autocast, pick_device, progress_bar, set_lr
from ddtree.training.corpus import corpus_files, load_streams, read_texts, split_files
from ddtree.training.tokenizer import MASK, train_tokenizer

TOKENIZER_BYTES = 64 << 20  # BPE merges are learned on the first 64 MB of the training split


@dataclass(frozen=True)
class TargetArch:
    layers: int = 10
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 768
    max_positions: int = 1024
    rope_theta: float = 10000.0

    def config(self, vocab_size: int, eos_id: int) -> Qwen3Config:
        return Qwen3Config(
            vocab_size=vocab_size, hidden_size=self.hidden, num_hidden_layers=self.layers,
            num_attention_heads=self.heads, num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
            intermediate_size=self.intermediate, max_position_embeddings=self.max_positions,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta}, tie_word_embeddings=True,
            bos_token_id=None, eos_token_id=eos_id, pad_token_id=eos_id,
        )


@torch.no_grad()
def evaluate_lm(model, windows: list[torch.Tensor], device: torch.device) -> dict[str, float]:
    """Held-out next-token loss (nats) and top-1 accuracy."""
    model.eval()
    loss = acc = 0.0
    for x in windows:
        with autocast(device):
            logits = model(input_ids=x[:, :-1], use_cache=False).logits.float()
        loss += F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).item()
        acc += (logits.argmax(-1) == x[:, 1:]).float().mean().item()
    model.train()
    return {"loss": loss / len(windows), "top1": acc / len(windows)}


def train_target(
    corpus: Sequence[str], out: str | Path, *, arch: TargetArch, tokenizer: str | None = None,
    vocab_size: int = 8192, globs: Sequence[str], seq_len: int = 512, batch_size: int = 32, lr: float = 2e-3,
    steps: int | None = None, minutes: float | None = None, device: str | None = None, seed: int = 0,
    eval_every: int = 200, log=print,
) -> dict:
    """Train a target on the corpus' training split and save it to `out`; returns the run's summary."""
    if seq_len > arch.max_positions:
        raise DDTreeError(f"--seq-len {seq_len} exceeds the model's {arch.max_positions} positions")
    dev = pick_device(device)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    out = Path(out)
    files = corpus_files(corpus, globs)
    if tokenizer:
        try:
            tok = AutoTokenizer.from_pretrained(tokenizer)
        except (OSError, ValueError) as exc:
            raise DDTreeError(f"cannot load the tokenizer in {tokenizer}: {str(exc).splitlines()[0]}") from None
    else:
        train_files, _ = split_files(files)
        log(f"training a byte-level BPE tokenizer ({vocab_size} tokens) on {len(train_files)} files")
        tok = train_tokenizer(read_texts(train_files, max_bytes=TOKENIZER_BYTES), vocab_size)
    if tok.convert_tokens_to_ids(MASK) in (None, tok.unk_token_id) or tok.eos_token_id is None:
        raise DDTreeError(f"the tokenizer needs an EOS token and a {MASK} token (train one: omit --tokenizer)")
    log("tokenizing the corpus")
    train, held = load_streams(tok, files, tok.eos_token_id, dev)
    log(f"corpus: {len(train):,} train tokens, {len(held):,} held-out tokens")

    config = arch.config(len(tok), tok.eos_token_id)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(dev).train()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"target: {n_params / 1e6:.2f} M parameters ({arch.layers} layers, hidden {arch.hidden}, vocab {len(tok)})")
    opt = adamw(model.parameters(), lr, dev)
    budget = Budget(steps, minutes, lr)
    eval_gen = torch.Generator().manual_seed(seed + 1)
    eval_windows = [held.windows(batch_size, seq_len + 1, eval_gen) for _ in range(4)]
    bar = progress_bar(budget, 0, "train-target")
    step, metrics = 0, {}
    while not budget.done(step):
        set_lr(opt, budget.lr_at(step))
        x = train.windows(batch_size, seq_len + 1, gen)
        with autocast(dev):
            logits = model(input_ids=x[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{step * batch_size * seq_len / budget.elapsed:,.0f}",
                        min=f"{budget.elapsed / 60:.1f}", refresh=False)
        if step % eval_every == 0:
            metrics = evaluate_lm(model, eval_windows, dev)
            bar.write(f"step {step}: train loss {loss.item():.3f}, held-out loss {metrics['loss']:.3f}, "
                      f"top-1 {metrics['top1']:.3f}")
    bar.close()
    metrics = evaluate_lm(model, eval_windows, dev)
    log(f"done: {step} steps in {budget.elapsed / 60:.1f} min, held-out loss {metrics['loss']:.3f}, "
        f"top-1 {metrics['top1']:.3f}")
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.eos_token_id
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    summary = {"parameters": n_params, "steps": step, "minutes": round(budget.elapsed / 60, 2),
               "train_tokens": len(train), "held_out_tokens": len(held), "tokens_seen": step * batch_size * seq_len,
               "held_out": metrics, "arch": asdict(arch), "seq_len": seq_len, "batch_size": batch_size, "lr": lr,
               "device": str(dev)}
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
