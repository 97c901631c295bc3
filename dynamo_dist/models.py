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
