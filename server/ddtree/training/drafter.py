"""`ddtree train-draft`: train a DFlash or DFlash2 drafter against a frozen transformers target on local text.

The published DFlash recipe, on the module the engine decodes with (`ddtree.models.draft.DFlashDraft`):
  * context features = outputs of the tapped target layers (forward hooks), for every corpus position;
  * per sequence, `blocks` random anchor positions a; block = [token at a] + [<|MASK|>] * (bs - 1) at
    positions a .. a+bs-1, embedded by the frozen target embedding;
  * all blocks of a sequence in one forward: a block's queries see context rows at positions < a (what
    the engine has committed when that token is the anchor) and the rows of their own block (bidirectional,
    or causal with --causal; the config says which: `is_causal` is always written);
  * logits through the frozen target LM head; labels are the target's own greedy next-token predictions
    at a+k-1 for slot k (hard distillation: acceptance is decided by the target's argmax, not the corpus),
    with cross-entropy weighted exp(-(k-1)/gamma), since a slot only counts when every earlier one matched.

`--arch dflash2` adds DFlash2's modules (ddtree.models.dflash2): the layers' convolutions train with the
backbone, and the candidate selector learns to pick, among each slot's top-k candidates of the drafter, the
target's own next token given the target's own previous one (teacher forcing: exactly the chain's situation
while it is still being accepted), with the same slot weights; its scores leave the backbone's logits alone.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from ddtree.errors import DDTreeError
from ddtree.models.dflash2 import SelectorConfig
from ddtree.models.draft import (
    DFlashDraft,
    TargetShape,
    default_taps,
    draft_config_dict,
    parse_draft_config,
    write_draft_checkpoint,
)
from ddtree.training.common import Budget, adamw, autocast, pick_device, progress_bar, set_lr
from ddtree.training.corpus import corpus_files, load_streams
from ddtree.training.tokenizer import MASK

STATE_FILE = "trainer_state.pt"  # fp32 weights + optimizer for --resume; not needed to serve the draft
ARCHS = ("dflash", "dflash2")


class FrozenTarget:
    """The target as the trainer needs it: tap features, greedy labels, embedding and LM head; no grads."""

    def __init__(self, path: str | Path, device: torch.device) -> None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        try:
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
        except (OSError, ValueError) as exc:
            raise DDTreeError(f"cannot load the target in {path}: {str(exc).splitlines()[0]}") from None
        self.model.to(device).eval().requires_grad_(False)
        self.config = self.model.config
        self.layers = self.model.model.layers
        self.embed = self.model.get_input_embeddings()
        self.head = self.model.get_output_embeddings()
        self.shape = TargetShape(self.config.hidden_size, self.embed.num_embeddings, len(self.layers))
        self.taps: tuple[int, ...] = ()
        self._captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            layer.register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(_module, _args, output):
            if i in self.taps:  # tap t = OUTPUT of decoder layer t (HF hidden_states[t + 1])
                self._captured[i] = output[0] if isinstance(output, tuple) else output

        return hook

    @torch.no_grad()
    def features(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tap features [B, T, k*H], last hidden states [B, T, H]) of ids [B, T]."""
        self._captured.clear()
        hidden = self.model.model(input_ids=ids, use_cache=False).last_hidden_state
        feats = torch.cat([self._captured[t] for t in self.taps], dim=-1)
        self._captured.clear()
        return feats, hidden


def mask_token_id(tokenizer, target: FrozenTarget) -> int:
    """The tokenizer's <|MASK|>, else the first embedding row past the tokenizer (Qwen3's 151669 rule)."""
    tid = tokenizer.convert_tokens_to_ids(MASK)
    if tid is not None and tid != tokenizer.unk_token_id:
        return int(tid)
    if target.shape.vocab_size > len(tokenizer):
        return len(tokenizer)
    raise DDTreeError(f"the target has no {MASK} token and no unused embedding row; add one to its tokenizer")


def parse_taps(spec: str, num_target_layers: int, num_draft_layers: int) -> list[int]:
    if spec == "auto":
        taps = default_taps(num_target_layers, num_draft_layers)
        if len(set(taps)) == len(taps) and all(0 <= t < num_target_layers for t in taps):
            return taps
        # the z-lab formula needs L > k + 3; spread over every layer of shallower targets instead
        k, last = num_draft_layers, num_target_layers - 1
        return sorted({round(i * last / (k - 1)) for i in range(k)}) if k > 1 else [last // 2]
    try:
        taps = [int(t) for t in spec.split(",") if t.strip()]
    except ValueError:
        raise DDTreeError(f"--taps must be 'auto' or comma-separated layer ids, got {spec!r}") from None
    if not taps or not all(0 <= t < num_target_layers for t in taps):
        raise DDTreeError(f"--taps {spec}: ids must lie in 0..{num_target_layers - 1}")
    return taps


def new_draft_config(target: FrozenTarget, *, layers: int, block_size: int, taps: list[int], mask_id: int,
                     causal: bool = False, selector: SelectorConfig | None = None) -> dict:
    """A z-lab config whose layer shapes mirror the target's (as the public drafts do), saying how its block is
    trained (`is_causal`); a DFlash2 one with a `selector`."""
    c = target.config
    rope = getattr(c, "rope_parameters", None) or {}
    return draft_config_dict(
        hidden_size=c.hidden_size, num_layers=layers, num_heads=c.num_attention_heads,
        num_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        intermediate_size=c.intermediate_size, vocab_size=target.shape.vocab_size, block_size=block_size,
        mask_token_id=mask_id, target_layer_ids=taps, num_target_layers=target.shape.num_layers,
        rope_theta=float(rope.get("rope_theta", getattr(c, "rope_theta", 1e6))),
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps, is_causal=causal,
        selector=selector,
    )


def block_batch(
    ids: torch.Tensor, blocks: int, block_size: int, mask_id: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random anchors and everything derived from them, for ids [B, T].

    Returns block ids and positions [B, n*bs], the visibility mask [B, 1, n*bs, T + n*bs] (keys = T context
    rows, then the block rows) and the label source positions [B, n, bs-1] (a+k-1: the target's prediction
    made there is the label of slot k).
    """
    b, t = ids.shape
    dev = ids.device
    # anchors in [1, T-bs]: at least one context row, and the whole block inside the window
    anchors = torch.rand(b, t - block_size, generator=generator).argsort(dim=1)[:, :blocks].to(dev) + 1
    offs = torch.arange(block_size, device=dev)
    pos = anchors[:, :, None] + offs  # [B, n, bs]
    block_ids = torch.full_like(pos, mask_id)
    block_ids[:, :, 0] = ids.gather(1, anchors)
    ctx_visible = torch.arange(t, device=dev)[None, None, :] < anchors[:, :, None]  # [B, n, T]
    ctx_visible = ctx_visible[:, :, None, :].expand(b, blocks, block_size, t).reshape(b, blocks * block_size, t)
    which = torch.arange(blocks, device=dev).repeat_interleave(block_size)
    same_block = (which[:, None] == which[None, :]).expand(b, -1, -1)
    mask = torch.cat([ctx_visible, same_block], dim=2)[:, None]
    return block_ids.flatten(1), pos.flatten(1), mask, pos[:, :, 1:] - 1


def slot_weights(block_size: int, gamma: float, device: torch.device) -> torch.Tensor:
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    return w / w.sum()


def draft_step(
    draft: DFlashDraft, target: FrozenTarget, ids: torch.Tensor, *, blocks: int, gamma: float,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted distillation loss, the drafted chain and the labels (both [B, n, bs-1]) for windows ids [B, T]:
    the chain is each slot's argmax, or a DFlash2 drafter's selector picks given the labels before them."""
    cfg = draft.config
    b, t = ids.shape
    feats, hidden = target.features(ids)
    block_ids, block_pos, mask, src = block_batch(ids, blocks, cfg.block_size, cfg.mask_token_id, generator)
    with torch.no_grad():
        src_hidden = hidden.gather(1, src.flatten(1)[:, :, None].expand(-1, -1, hidden.shape[-1]))
        labels = target.head(src_hidden).argmax(-1).view(b, blocks, cfg.block_size - 1)
    ctx_pos = torch.arange(t, device=ids.device).expand(b, t)
    out = draft(target.embed(block_ids), block_pos, feats, ctx_pos, mask=mask)
    out = out.view(b, blocks, cfg.block_size, -1)[:, :, 1:]
    logits = draft.finish_logits(target.head(out)).float()
    weights = slot_weights(cfg.block_size, gamma, ids.device)
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view_as(labels)
    loss = (ce * weights).sum(-1).mean()
    if draft.candidate_selector is None:
        return loss, logits.argmax(-1), labels
    selector_loss, picks = selector_step(draft, logits, out, block_ids.view(b, blocks, -1)[:, :, 0], labels,
                                         weights)
    return loss + selector_loss, picks, labels


def selector_step(draft: DFlashDraft, logits: torch.Tensor, hidden: torch.Tensor, anchors: torch.Tensor,
                  labels: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidate selector's loss and picks [B, n, D]: among each slot's top-k candidates (logits [B, n, D, V],
    detached) scored after the target's previous token (the anchor, then the labels), cross-entropy towards the
    label where it is a candidate; slots weighted like the backbone's."""
    selector = draft.candidate_selector
    unary, candidates = logits.detach().topk(min(selector.top_k, logits.shape[-1]), dim=-1)
    previous = torch.cat([anchors[..., None], labels[..., :-1]], dim=-1)
    scores = selector.scores(unary, candidates, previous[..., None], hidden)[..., 0, :]
    hit = candidates == labels[..., None]
    ce = F.cross_entropy(scores.flatten(0, 2), hit.float().argmax(-1).flatten(), reduction="none")
    ce = ce.view_as(labels) * hit.any(-1)
    picks = candidates.gather(-1, scores.argmax(-1, keepdim=True))[..., 0]
    return (ce * weights).sum(-1).mean(), picks


def acceptance_length(pred: torch.Tensor, labels: torch.Tensor) -> float:
    """Teacher-forced τ estimate of the chain the drafter drafts: 1 + leading slots where its picks match the
    target (a DFlash2 selector's picks follow the labels, which the chain equals for as long as it is accepted)."""
    run = (pred == labels).int().cumprod(dim=-1).sum(-1)
    return 1.0 + run.float().mean().item()


@torch.no_grad()
def evaluate_draft(draft: DFlashDraft, target: FrozenTarget, windows: list[torch.Tensor], blocks: int,
                   gamma: float, device: torch.device) -> dict[str, float]:
    draft.eval()
    gen = torch.Generator().manual_seed(1234)  # the same anchors at every evaluation
    loss = tau = acc1 = 0.0
    for x in windows:
        with autocast(device):
            step_loss, pred, labels = draft_step(draft, target, x, blocks=blocks, gamma=gamma, generator=gen)
        loss += step_loss.item()
        tau += acceptance_length(pred, labels)
        acc1 += (pred[:, :, 0] == labels[:, :, 0]).float().mean().item()
    draft.train()
    n = len(windows)
    return {"loss": loss / n, "tau": tau / n, "slot1_acc": acc1 / n}


def init_weights(draft: DFlashDraft, std: float = 0.02) -> None:
    """Small random projections; a DFlash2 drafter's convolutions start as the identity (static tap 1 on the
    current row, no dynamic taps), so that it starts as the DFlash drafter it extends."""
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("base_kernel"):
                p.zero_()[:, 0] = 1.0
            elif name.endswith("kernel_projection.weight"):
                p.zero_()
            elif "norm" not in name:
                p.normal_(0.0, std)


def save(out: Path, config: dict, draft: DFlashDraft, opt: torch.optim.Optimizer, step: int, elapsed: float) -> None:
    write_draft_checkpoint(out, config, draft.state_dict())
    torch.save({"model": draft.state_dict(), "optimizer": opt.state_dict(), "step": step, "elapsed": elapsed},
               out / STATE_FILE)


def train_draft(
    target_dir: str | Path, corpus: Sequence[str], out: str | Path, *, layers: int = 5, block_size: int = 16,
    taps: str = "auto", globs: Sequence[str], seq_len: int = 512, blocks: int = 16, batch_size: int = 16,
    lr: float = 6e-4, gamma: float = 7.0, steps: int | None = None, minutes: float | None = None,
    device: str | None = None, seed: int = 0, eval_every: int = 200, save_every: int = 1000,
    resume: bool = False, arch: str = "dflash", causal: bool = False,
    selector: SelectorConfig | None = None, log=print,
) -> dict:
    """Train (or with `resume`, continue) a drafter for the target into `out`; returns the run's summary. `arch`
    "dflash2" trains a DFlash2 drafter with `selector`'s fields (default: the published drafters'); `causal`
    makes every layer causal inside the block (default: bidirectional, as the demo drafter)."""
    dev = pick_device(device)
    torch.manual_seed(seed)
    out = Path(out)
    if arch not in ARCHS:
        raise DDTreeError(f"--arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    if block_size < 2:
        raise DDTreeError("--block-size must be at least 2")
    if seq_len - block_size < blocks:
        raise DDTreeError(f"--seq-len {seq_len} leaves room for fewer than {blocks} anchors of a {block_size}-block")
    files = corpus_files(corpus, globs)
    target = FrozenTarget(target_dir, dev)
    try:
        tok = AutoTokenizer.from_pretrained(target_dir)
    except (OSError, ValueError) as exc:
        raise DDTreeError(f"cannot load the tokenizer of {target_dir}: {str(exc).splitlines()[0]}") from None
    state = None
    if resume:
        if not (out / STATE_FILE).is_file():
            raise DDTreeError(f"--resume: {out / STATE_FILE} does not exist")
        config = json.loads((out / "config.json").read_text())
        state = torch.load(out / STATE_FILE, map_location="cpu")
    else:
        tap_ids = parse_taps(taps, target.shape.num_layers, layers)
        if arch == "dflash2":
            selector = selector or SelectorConfig(conv_kernel_size=2, conv_group_size=16, selector_rank=256,
                                                  selector_top_k=16)
        config = new_draft_config(target, layers=layers, block_size=block_size, taps=tap_ids,
                                  mask_id=mask_token_id(tok, target), causal=causal,
                                  selector=selector if arch == "dflash2" else None)
    cfg = parse_draft_config(config, target.shape)
    target.taps = cfg.target_layer_ids
    draft = DFlashDraft(cfg)
    if state is None:
        init_weights(draft)
    else:
        draft.load_state_dict(state["model"])
    draft.place(dev, torch.float32).train()
    opt = adamw(draft.parameters(), lr, dev)
    if state is not None:
        opt.load_state_dict(state["optimizer"])
    start = state["step"] if state else 0
    gen = torch.Generator().manual_seed(seed + start)  # a resumed run does not replay the same windows
    n_params = sum(p.numel() for p in draft.parameters())
    resuming = f", resuming at step {start}" if start else ""
    log(f"draft: {n_params / 1e6:.2f} M parameters, {cfg.describe()}, taps {list(cfg.target_layer_ids)}, "
        f"mask id {cfg.mask_token_id}{resuming}")

    log("tokenizing the corpus")
    train, held = load_streams(tok, files, tok.eos_token_id, dev)
    log(f"corpus: {len(train):,} train tokens, {len(held):,} held-out tokens")
    eval_gen = torch.Generator().manual_seed(seed + 1)
    eval_windows = [held.windows(batch_size, seq_len, eval_gen) for _ in range(4)]

    budget = Budget(steps, minutes, lr, elapsed=state["elapsed"] if state else 0.0)
    bar = progress_bar(budget, start, "train-draft")
    step = start
    initial = evaluate_draft(draft, target, eval_windows, blocks, gamma, dev)
    log(f"step {step}: held-out loss {initial['loss']:.3f}, tau {initial['tau']:.2f}, "
        f"slot-1 acc {initial['slot1_acc']:.3f}")
    first_loss = None
    while not budget.done(step):
        set_lr(opt, budget.lr_at(step))
        x = train.windows(batch_size, seq_len, gen)
        with autocast(dev):
            loss, pred, labels = draft_step(draft, target, x, blocks=blocks, gamma=gamma, generator=gen)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        first_loss = loss.item() if first_loss is None else first_loss
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", tau=f"{acceptance_length(pred, labels):.2f}",
                        min=f"{budget.elapsed / 60:.1f}", refresh=False)
        if step % eval_every == 0:
            m = evaluate_draft(draft, target, eval_windows, blocks, gamma, dev)
            bar.write(f"step {step}: train loss {loss.item():.3f}, held-out loss {m['loss']:.3f}, "
                      f"tau {m['tau']:.2f}, slot-1 acc {m['slot1_acc']:.3f}")
        if step % save_every == 0:
            save(out, config, draft, opt, step, budget.elapsed)
    bar.close()
    metrics = evaluate_draft(draft, target, eval_windows, blocks, gamma, dev)
    save(out, config, draft, opt, step, budget.elapsed)
    log(f"done: {step} steps in {budget.elapsed / 60:.1f} min, held-out tau {metrics['tau']:.2f} "
        f"(teacher-forced estimate), slot-1 acc {metrics['slot1_acc']:.3f}; wrote {out}")
    summary = {"architecture": cfg.architecture, "parameters": n_params, "steps": step,
               "minutes": round(budget.elapsed / 60, 2), "first_loss": first_loss, "held_out_initial": initial,
               "held_out": metrics, "seq_len": seq_len,
               "blocks": blocks, "batch_size": batch_size, "lr": lr, "gamma": gamma, "device": str(dev)}
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
