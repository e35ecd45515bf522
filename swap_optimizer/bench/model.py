"""The benchmark's embedded model: a GPT-style decoder (pre-norm blocks, causal
self-attention, 4x MLP, tied input and output embeddings), sized by preset."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int

    def block_param_count(self) -> int:
        """Parameters of one block: qkv, proj, fc, fc2 with biases; two LayerNorms."""
        h = self.hidden
        return 12 * h * h + 13 * h

    def param_count(self) -> int:
        """Parameters of GPT(config), without building it."""
        h = self.hidden
        return self.vocab * h + self.seq_len * h + self.layers * self.block_param_count() + 2 * h

    def as_dict(self) -> dict:
        return asdict(self)


# GPT-2 small and medium and GPT-3 XL sizes, and two for CPUs, whose small
# vocabularies keep the embedding's share of the params near the large models' (8-30%).
PRESETS = {
    "micro": GPTConfig(layers=2, hidden=128, heads=4, vocab=512, seq_len=32),
    "tiny": GPTConfig(layers=6, hidden=256, heads=4, vocab=2048, seq_len=64),
    "125m": GPTConfig(layers=12, hidden=768, heads=12, vocab=50304, seq_len=1024),
    "350m": GPTConfig(layers=24, hidden=1024, heads=16, vocab=50304, seq_len=1024),
    "1.3b": GPTConfig(layers=24, hidden=2048, heads=16, vocab=50304, seq_len=1024),
}


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        h = config.hidden
        self.heads = config.heads
        self.norm1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.norm2 = nn.LayerNorm(h)
        self.fc = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(hidden, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, hidden // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, hidden))
        return x + self.fc2(F.gelu(self.fc(self.norm2(x))))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab, config.hidden)
        self.position_embedding = nn.Embedding(config.seq_len, config.hidden)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.token_embedding.weight.t()  # tied output embedding

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
