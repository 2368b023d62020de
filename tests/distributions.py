"""Exact target distributions over short continuations, and a chi-square check of sampled counts.

On a tiny vocabulary the exact distribution of the first few sampled tokens is computable from the
target; a sampler is lossless when its draws fit it. Written independently of ddtree.sampling.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
from scipy.stats import binomtest, chisquare


def reference_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> np.ndarray:
    """The intended distribution of one pick: softmax(logits / T), then top-k, then top-p over what top-k kept
    (its mass renormalized, as vLLM applies them)."""
    probs = torch.softmax(logits.double() / temperature, dim=-1).numpy()
    order = np.argsort(-probs, kind="stable")
    if top_k:
        probs = np.where(np.isin(np.arange(len(probs)), order[:top_k]), probs, 0.0)
        probs = probs / probs.sum()
    keep = np.zeros_like(probs, dtype=bool)
    mass = 0.0
    for rank, token in enumerate(order):
        if (top_k and rank >= top_k) or mass >= top_p:
            break
        keep[token] = True
        mass += probs[token]
    probs = np.where(keep, probs, 0.0)
    return probs / probs.sum()


def penalized(logits: torch.Tensor, prompt: list[int], generated: tuple[int, ...], repetition: float,
              frequency: float, presence: float) -> torch.Tensor:
    """The penalties as their definitions state them: repetition over prompt and generated tokens
    (positive logits divided, negative multiplied), frequency and presence over the generated ones."""
    out = logits.double().clone()
    for token in set(prompt) | set(generated):
        out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
    for token in set(generated):
        out[token] -= frequency * generated.count(token) + presence
    return out


def exact_joint(model: torch.nn.Module, prompt: list[int], vocab: int, steps: int, repetition_penalty: float = 1.0,
                frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                **kw: float) -> dict[tuple[int, ...], float]:
    """Probability of every `steps`-token continuation of `prompt` under the target (an HF causal LM)."""
    joint = dict.fromkeys(itertools.product(range(vocab), repeat=steps), 1.0)
    with torch.no_grad():
        for depth in range(steps):
            for prefix in itertools.product(range(vocab), repeat=depth):
                logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1]
                p = reference_probs(penalized(logits, prompt, prefix, repetition_penalty, frequency_penalty,
                                              presence_penalty), **kw)
                for seq in joint:
                    if seq[:depth] == prefix:
                        joint[seq] *= p[seq[depth]]
    return joint


def fit_p_value(counts: dict[tuple[int, ...], int], joint: dict[tuple[int, ...], float]) -> float:
    """Chi-square p-value of `counts` against `joint`, the rarest cells pooled so every expected count is >= 5.

    Asserts first that no draw fell outside the distribution's support.
    """
    draws = sum(counts.values())
    impossible = [c for c, n in counts.items() if n and joint[c] == 0]
    assert not impossible, f"draws outside the support: {impossible[:3]}"
    observed, expected, pool_o, pool_e = [], [], 0, 0.0
    for cell in sorted(joint, key=joint.get, reverse=True):
        e = joint[cell] * draws
        if e >= 5:
            observed.append(counts.get(cell, 0))
            expected.append(e)
        else:
            pool_o += counts.get(cell, 0)
            pool_e += e
    if pool_e > 0:  # a small support can leave no rare cells
        observed.append(pool_o)
        expected.append(pool_e)
    return float(chisquare(observed, expected).pvalue)


def event_p_value(counts: dict[tuple[int, ...], int], joint: dict[tuple[int, ...], float], event) -> float:
    """Two-sided binomial p-value of how often `event(sequence)` happened against its exact probability:
    a narrow statistic catches a shift that the full chi-square spreads over too many cells."""
    draws = sum(counts.values())
    hits = sum(n for seq, n in counts.items() if event(seq))
    return float(binomtest(hits, draws, sum(p for seq, p in joint.items() if event(seq))).pvalue)
