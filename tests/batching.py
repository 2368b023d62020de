"""Helpers for the batch tests (tests/engine): decoding requests together and watching what each step verified."""

from __future__ import annotations


def draft_nodes_while_all_run(batch, requests: list[tuple]) -> tuple[list, list[int]]:
    """Decode (prompt, params, method, budget) `requests` together to the end: their sequences, and the draft
    nodes each step verified while all of them ran (a step's tree sizes, summed over the requests)."""
    seqs = [batch.add(prompt, params, method=method, budget=budget) for prompt, params, method, budget in requests]
    nodes = []
    while batch.has_work():
        batch.step()
        if batch.last.sequences == len(requests):
            nodes.append(batch.last.draft_nodes)
    return seqs, nodes
