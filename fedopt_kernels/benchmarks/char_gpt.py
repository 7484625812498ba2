"""A small character-level GPT and its corpus: the Python standard library's own source.

The model is the usual pre-LayerNorm decoder (token + position embeddings, ``n_layer``
blocks of causal self-attention and a 4x MLP, a final LayerNorm, an output head tied
to the token embedding), written here so the DiLoCo example and benchmark need nothing
else.  Tokens are bytes (vocabulary 256): every machine with Python has the corpus
(``sysconfig.get_paths()["stdlib"]``) and the same tokenizer.

``PRESETS["10m"]`` is about 10.7M parameters; ``"tiny"`` (0.4M) is what the benchmark
trains on two shared CPU cores in seconds.
"""

from __future__ import annotations

import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Tuple

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["GPTConfig", "PRESETS", "CharGPT", "stdlib_corpus", "sample_batch"]


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    vocab_size: int = 256


PRESETS = {
    "10m": GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=128),
    "tiny": GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=64),
}


class _Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(c.n_embd), nn.LayerNorm(c.n_embd)
        self.qkv, self.proj = nn.Linear(c.n_embd, 3 * c.n_embd), nn.Linear(c.n_embd, c.n_embd)
        self.fc, self.out = nn.Linear(c.n_embd, 4 * c.n_embd), nn.Linear(4 * c.n_embd, c.n_embd)
        self.n_head = c.n_head

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CharGPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.config = c
        self.tok = nn.Embedding(c.vocab_size, c.n_embd)
        self.pos = nn.Embedding(c.block_size, c.n_embd)
        self.blocks = nn.ModuleList(_Block(c) for _ in range(c.n_layer))
        self.ln = nn.LayerNorm(c.n_embd)
        self.apply(self._init)
        for b in self.blocks:  # GPT-2's scaled init of the residual projections
            for lin in (b.proj, b.out):
                nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * c.n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.ln(x) @ self.tok.weight.t()  # the head tied to the embedding
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def stdlib_corpus(max_bytes: int = 4_000_000) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(train, val)`` uint8 tensors: the standard library's ``*.py`` files (sorted paths,
    test suites left out), concatenated up to ``max_bytes``; the last 10% is validation."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if any(p in ("test", "tests", "idlelib", "site-packages") for p in rel):
            continue
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    data = torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8)
    cut = int(len(data) * 0.9)
    return data[:cut].clone(), data[cut:].clone()


def sample_batch(data: torch.Tensor, batch: int, block: int, generator: torch.Generator):
    """``(x, y)`` int64 ``[batch, block]``: random windows and the next bytes."""
    starts = torch.randint(0, len(data) - block - 1, (batch,), generator=generator)
    idx = starts[:, None] + torch.arange(block + 1)
    w = data[idx].long()
    return w[:, :-1], w[:, 1:]
