"""What both trainers share: device choice, a step/minute budget with its LR schedule, progress output."""

from __future__ import annotations

import math
import sys
import time
from contextlib import nullcontext

import torch
from tqdm import tqdm

from ddtree.errors import DDTreeError


def pick_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise DDTreeError(f"--device {name}: CUDA is not available on this machine")
    return torch.device(name)


def autocast(device: torch.device):
    """bf16 autocast on GPUs (fp32 master weights); plain fp32 on CPU, where bf16 matmuls are slow."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


class Budget:
    """Train for `steps`, or `minutes`, or whichever ends first; drives a warmup + cosine LR schedule.

    Progress is a fraction in [0, 1] so that a time budget decays the LR just like a step budget does.
    `elapsed` carries the wall time of earlier runs of a resumed job.
    """

    def __init__(self, steps: int | None, minutes: float | None, lr: float, warmup: int = 100,
                 elapsed: float = 0.0) -> None:
        if steps is None and minutes is None:
            steps = 1000
        if (steps is not None and steps < 1) or (minutes is not None and minutes <= 0):
            raise DDTreeError("--steps must be >= 1 and --minutes > 0")
        self.steps, self.seconds, self.lr = steps, None if minutes is None else minutes * 60.0, lr
        self.warmup = min(warmup, max(1, steps // 10)) if steps else warmup
        self.t0 = time.monotonic() - elapsed

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def progress(self, step: int) -> float:
        parts = [step / self.steps] if self.steps else []
        if self.seconds:
            parts.append(self.elapsed / self.seconds)
        return min(1.0, max(parts))

    def done(self, step: int) -> bool:
        return self.progress(step) >= 1.0

    def lr_at(self, step: int) -> float:
        """Linear warmup, then cosine decay to 10% of the peak."""
        warm = min(1.0, (step + 1) / self.warmup)
        return self.lr * warm * (0.1 + 0.45 * (1.0 + math.cos(math.pi * self.progress(step))))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def progress_bar(budget: Budget, start_step: int, desc: str) -> tqdm:
    """A step bar when the budget is in steps; otherwise an open-ended one (the postfix shows time left)."""
    return tqdm(total=budget.steps, initial=start_step, desc=desc, unit="step", file=sys.stderr,
                dynamic_ncols=True, mininterval=1.0 if sys.stderr.isatty() else 10.0)


def adamw(params, lr: float, device: torch.device, weight_decay: float = 0.1) -> torch.optim.AdamW:
    """AdamW with decay on matrices only (norm gains stay undecayed)."""
    params = [p for p in params if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=device.type == "cuda")
