"""Synthetic, learnable token data, identical on every rank and for every layout.

The tokens live on a fixed random subset of a quarter of the vocabulary (at least 2 tokens); each
sequence starts at a random token of the subset and follows a fixed random cycle through it
(x[t+1] = next[x[t]]). A model learns first the subset, then the successor of each token, so the loss
falls from ln(vocab) within a few steps.
"""

from __future__ import annotations

import torch


def global_batch(seed: int, step: int, samples: int, seq_len: int, vocab: int) -> torch.Tensor:
    """The step's global batch, [samples, seq_len + 1] int64 tokens (inputs are [:, :-1], targets [:, 1:])."""
    subset = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[: max(2, vocab // 4)]
    successor = torch.zeros(vocab, dtype=torch.long)
    successor[subset] = subset.roll(-1)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step + 1)
    tokens = torch.empty(samples, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = subset[torch.randint(0, len(subset), (samples,), generator=gen)]
    for t in range(seq_len):
        tokens[:, t + 1] = successor[tokens[:, t]]
    return tokens


def micro_batch(tokens: torch.Tensor, dp_rank: int, dp: int, micro: int, b: int) -> torch.Tensor:
    """Samples of micro-batch `micro` on dp replica `dp_rank`: rows (micro * dp + dp_rank) * b ... + b."""
    start = (micro * dp + dp_rank) * b
    return tokens[start : start + b]
