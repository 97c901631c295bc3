"""The zoo's architectures: each built from its library's DEFAULT config, scaled down only in
width, depth and vocabulary (caches, ties, dropout, activations and attention as shipped), with
random weights and a fixed seed; and a batch of GLOBAL inputs per step.

Every entry says which family it stands for, so that the report reads as coverage.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import torch
import torch.nn as nn

VOCAB = 256
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
# decoder/encoder layers per model (``--layers`` of the zoo sets DYNAMO_DIST_ZOO_LAYERS for its
# workers: deeper stacks exercise the sharing of repeated layers' compiled code)
LAYERS = int(os.environ.get("DYNAMO_DIST_ZOO_LAYERS", "2"))
FFN = 128
BATCH = 4      # global batch; divisible by the data-parallel sizes the zoo runs
SEQ = 16
IMAGE = 32


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """One architecture. ``build()`` -> the model (random weights, seed 0); ``batch(step)`` ->
    (args, kwargs) of GLOBAL inputs (the same on every rank); the forward returns an object with
    ``.loss`` or the loss itself."""

    name: str
    family: str
    build: Callable[[], nn.Module]
    batch: Callable[[int], tuple[tuple, dict]]
    notes: str = ""


def _ids(step: int, shape=(BATCH, SEQ), high: int = VOCAB, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + salt)
    return torch.randint(3, high, shape, generator=g)  # ids 0-2 are special tokens


def _lm_batch(step: int):
    ids = _ids(step)
    return (), {"input_ids": ids, "labels": ids}


def _mlm_batch(step: int):
    ids = _ids(step)
    return (), {"input_ids": ids, "labels": _ids(step, salt=1)}


def _seq2seq_batch(step: int):
    return (), {"input_ids": _ids(step), "labels": _ids(step, salt=1)}


def _image_batch(step: int, classes: int = 2, size: int = IMAGE):
    g = torch.Generator().manual_seed(1000 * step)
    pixels = torch.randn(BATCH, 3, size, size, generator=g)
    return (), {"pixel_values": pixels, "labels": torch.randint(0, classes, (BATCH,), generator=g)}


def _hf(cls_name: str, config_name: str, **sizes) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        config = getattr(transformers, config_name)(**sizes)
        torch.manual_seed(0)
        return getattr(transformers, cls_name)(config).float()
    return build


_LM = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)


class ConvNet(nn.Module):
    """Conv2d + BatchNorm2d + ReLU + max-pool, twice, then a Linear classifier and the loss: the
    smallest program with every op family a ConvNet brings."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Linear(32 * (IMAGE // 4) ** 2, classes)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.features(pixel_values)
        return nn.functional.cross_entropy(self.classifier(h.flatten(1)), labels)


def _convnet() -> nn.Module:
    torch.manual_seed(0)
    return ConvNet()


# transformers writes config.problem_type on the first forward with labels when it is unset, a
# change Dynamo guards on: one recompile with any backend; set up front, as a user would
_CLASSIFY = "single_label_classification"

MODELS: dict[str, ZooModel] = {m.name: m for m in [
    ZooModel("llama", "decoder LM: RoPE, GQA, SwiGLU, RMSNorm (Llama, Mistral, Qwen family)",
             _hf("LlamaForCausalLM", "LlamaConfig", hidden_size=HIDDEN, intermediate_size=FFN,
                 num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                 num_key_value_heads=KV_HEADS, **_LM), _lm_batch),
    ZooModel("gpt2", "decoder LM: Conv1D, fused q|k|v, tied head, dropout, learned positions",
             _hf("GPT2LMHeadModel", "GPT2Config", n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                 n_positions=64, **_LM), _lm_batch),
    ZooModel("gpt_neox", "decoder LM: parallel residual, fused head-major qkv, partial rotary",
             _hf("GPTNeoXForCausalLM", "GPTNeoXConfig", hidden_size=HIDDEN,
                 intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                 max_position_embeddings=64, **_LM), _lm_batch),
    ZooModel("qwen2", "decoder LM: q/k/v bias, GQA",
             _hf("Qwen2ForCausalLM", "Qwen2Config", hidden_size=HIDDEN, intermediate_size=FFN,
                 num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                 num_key_value_heads=KV_HEADS, **_LM), _lm_batch),
    ZooModel("gemma", "decoder LM: tied head, GeGLU, scaled embeddings, multi-query attention",
             _hf("GemmaForCausalLM", "GemmaConfig", hidden_size=HIDDEN, intermediate_size=FFN,
                 num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=1,
                 head_dim=HIDDEN // HEADS, pad_token_id=0, **_LM), _lm_batch),
    ZooModel("phi", "decoder LM: attention and MLP in parallel, LayerNorm, biases, partial rotary",
             _hf("PhiForCausalLM", "PhiConfig", hidden_size=HIDDEN, intermediate_size=FFN,
                 num_hidden_layers=LAYERS, num_attention_heads=HEADS, **_LM), _lm_batch),
    ZooModel("opt", "decoder LM: ReLU MLP, learned offset positions, tied head, dropout",
             _hf("OPTForCausalLM", "OPTConfig", hidden_size=HIDDEN, ffn_dim=FFN,
                 num_hidden_layers=LAYERS, num_attention_heads=HEADS, word_embed_proj_dim=HIDDEN,
                 max_position_embeddings=64, pad_token_id=0, **_LM), _lm_batch),
    ZooModel("bloom", "decoder LM: ALiBi, fused head-major qkv, tied head, embedding LayerNorm",
             _hf("BloomForCausalLM", "BloomConfig", hidden_size=HIDDEN, n_layer=LAYERS,
                 n_head=HEADS, **_LM), _lm_batch),
    ZooModel("gptj", "decoder LM: attention and MLP in parallel, interleaved partial rotary",
             _hf("GPTJForCausalLM", "GPTJConfig", n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                 rotary_dim=8, n_positions=64, **_LM), _lm_batch),
    ZooModel("mpt", "decoder LM: ALiBi, fused qkv, no biases, tied head",
             _hf("MptForCausalLM", "MptConfig", d_model=HIDDEN, n_layers=LAYERS, n_heads=HEADS,
                 max_seq_len=64, **_LM), _lm_batch),
    ZooModel("gpt_neo", "decoder LM: global and local (windowed) attention layers, learned "
                        "positions",
             _hf("GPTNeoForCausalLM", "GPTNeoConfig", hidden_size=HIDDEN, num_layers=LAYERS,
                 num_heads=HEADS, attention_types=[[["global", "local"], LAYERS // 2]] +
                 ([[["global"], 1]] if LAYERS % 2 else []),
                 max_position_embeddings=64, window_size=8, **_LM), _lm_batch),
    ZooModel("bert", "encoder: masked LM, tied decoder weight and bias, token types, dropout",
             _hf("BertForMaskedLM", "BertConfig", hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                 num_attention_heads=HEADS, intermediate_size=FFN, max_position_embeddings=64,
                 vocab_size=VOCAB), _mlm_batch),
    ZooModel("t5", "encoder-decoder: relative position bias, cross-attention, 4-way tied "
                   "embedding, dropout",
             _hf("T5ForConditionalGeneration", "T5Config", d_model=HIDDEN, d_kv=HIDDEN // HEADS,
                 d_ff=FFN, num_layers=LAYERS, num_heads=HEADS, vocab_size=VOCAB,
                 decoder_start_token_id=0), _seq2seq_batch),
    ZooModel("deberta_v2", "encoder: disentangled relative-position attention, masked LM",
             _hf("DebertaV2ForMaskedLM", "DebertaV2Config", hidden_size=HIDDEN,
                 num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FFN,
                 max_position_embeddings=64, vocab_size=VOCAB), _mlm_batch),
    ZooModel("bart", "encoder-decoder: learned offset positions, cross-attention, tied "
                     "embeddings, dropout",
             _hf("BartForConditionalGeneration", "BartConfig", d_model=HIDDEN,
                 encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=HEADS,
                 decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN,
                 max_position_embeddings=64, vocab_size=VOCAB, pad_token_id=0,
                 decoder_start_token_id=2), _seq2seq_batch),
    ZooModel("mixtral", "MoE LM: top-2 routing over 3-D expert weights",
             _hf("MixtralForCausalLM", "MixtralConfig", hidden_size=HIDDEN,
                 intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                 num_key_value_heads=KV_HEADS, num_local_experts=4, **_LM), _lm_batch),
    ZooModel("vit", "vision transformer: patch convolution, CLS token, classifier",
             _hf("ViTForImageClassification", "ViTConfig", hidden_size=HIDDEN,
                 num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FFN,
                 image_size=IMAGE, patch_size=8, problem_type=_CLASSIFY), _image_batch),
    ZooModel("resnet", "ConvNet: residual bottlenecks, BatchNorm, max-pool, adaptive avg-pool",
             _hf("ResNetForImageClassification", "ResNetConfig", embedding_size=16,
                 hidden_sizes=[16, 32], depths=[1, 1], problem_type=_CLASSIFY), _image_batch),
    ZooModel("convnext", "ConvNet: depthwise 7x7 convolutions, channels-last LayerNorm, "
                         "layer scale",
             _hf("ConvNextForImageClassification", "ConvNextConfig", num_stages=2,
                 hidden_sizes=[16, 32], depths=[1, 1], problem_type=_CLASSIFY, num_labels=2),
             _image_batch),
    ZooModel("convnet", "ConvNet: Conv2d, BatchNorm2d, ReLU, max-pool, Linear",
             _convnet, lambda step: _image_batch(step, classes=10)),
]}


def loss_of(out: Any) -> torch.Tensor:
    """The loss a forward returned (transformers' ``ModelOutput.loss`` or the tensor)."""
    return out.loss if hasattr(out, "loss") else out
