"""Real architectures with random weights for the demo, tests and benchmarks (no hub access)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaSize:
    """The demo's small Llama. All sizes are global."""

    hidden: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 512
    vocab: int = 1024
    seq: int = 128
    batch: int = 8

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} must be a multiple of heads {self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} must be a multiple of kv_heads {self.kv_heads}")


def build_llama(size: LlamaSize, seed: int = 0, attn: str = "sdpa") -> nn.Module:
    """transformers' LlamaForCausalLM with random weights (fixed seed), fp32.

    ``attn``: transformers' attention implementation, "sdpa" (its default:
    ``F.scaled_dot_product_attention``) or "eager" (matmul + softmax).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=size.hidden, intermediate_size=size.intermediate,
                      num_hidden_layers=size.layers, num_attention_heads=size.heads,
                      num_key_value_heads=size.kv_heads, vocab_size=size.vocab,
                      max_position_embeddings=max(256, size.seq), tie_word_embeddings=False,
                      use_cache=False)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).float()


def token_batch(size: LlamaSize, step: int, seed: int = 1234) -> torch.Tensor:
    """A fixed random batch of token ids, [batch, seq], the same on every rank."""
    g = torch.Generator().manual_seed(seed + step)
    return torch.randint(0, size.vocab, (size.batch, size.seq), generator=g)


class ConvNet(nn.Module):
    """A small image classifier: Conv2d(3, 8, 3, padding 1) + BatchNorm2d + ReLU + MaxPool2d(2) +
    Linear, cross_entropy loss. Input [batch, 3, 16, 16] (GLOBAL), labels [batch] in [0, 10)."""

    def __init__(self, size: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(8 * (size // 2) ** 2, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.pool(torch.relu(self.bn(self.conv(x))))
        return nn.functional.cross_entropy(self.fc(h.flatten(1)), labels)


def image_batch(step: int, batch: int = 4, size: int = 16, classes: int = 10,
                seed: int = 4321) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed random batch (images [batch, 3, size, size], labels [batch]), the same on every
    rank."""
    g = torch.Generator().manual_seed(seed + step)
    return (torch.randn(batch, 3, size, size, generator=g),
            torch.randint(0, classes, (batch,), generator=g))
