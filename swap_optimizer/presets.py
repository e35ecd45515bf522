"""Parameter shapes of public dense decoders, from a preset name or a Hugging
Face config.json, in the order `model.parameters()` yields them (tied output
heads listed once), for planning memory without building the model."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

# The Hugging Face model types whose parameter shapes this module knows.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral", "gpt2")


@dataclass(frozen=True)
class DecoderShape:
    """What decides a decoder's parameter shapes (and its activation estimate).

    qkv_bias / o_bias / mlp_bias: biases on the q, k, v projections, on the
    output projection and on the MLP (Qwen2: q, k, v only; Llama's
    attention_bias: q, k, v and o). gpt2 has biases and LayerNorm biases
    everywhere, a learned position embedding of max_positions rows and
    Conv1D weights stored (in, out)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    max_positions: int = 0

    def param_shapes(self) -> list[tuple[int, ...]]:
        if self.model_type == "gpt2":
            return self._gpt2_shapes()
        h, q, kv, inner = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, \
            self.intermediate_size
        shapes: list[tuple[int, ...]] = [(self.vocab_size, h)]
        for _ in range(self.num_layers):
            for rows, cols, bias in ((q, h, self.qkv_bias), (kv, h, self.qkv_bias), (kv, h, self.qkv_bias),
                                     (h, q, self.o_bias), (inner, h, self.mlp_bias), (inner, h, self.mlp_bias),
                                     (h, inner, self.mlp_bias)):
                shapes += [(rows, cols)] + ([(rows,)] if bias else [])
            shapes += [(h,), (h,)]  # input and post-attention RMSNorm
        shapes.append((h,))  # final norm
        if not self.tie_word_embeddings:
            shapes.append((self.vocab_size, h))
        return shapes

    def _gpt2_shapes(self) -> list[tuple[int, ...]]:
        h, inner = self.hidden_size, self.intermediate_size
        shapes: list[tuple[int, ...]] = [(self.vocab_size, h), (self.max_positions, h)]
        for _ in range(self.num_layers):
            shapes += [(h,), (h,), (h, 3 * h), (3 * h,), (h, h), (h,), (h,), (h,), (h, inner), (inner,), (inner, h),
                       (h,)]
        shapes += [(h,), (h,)]
        if not self.tie_word_embeddings:
            shapes.append((self.vocab_size, h))
        return shapes

    def numel(self) -> int:
        return sum(math.prod(shape) for shape in self.param_shapes())


def _llama_like(model_type, vocab, hidden, layers, intermediate, heads, kv_heads, tie, qkv_bias=False):
    return DecoderShape(model_type, vocab, hidden, layers, intermediate, heads, kv_heads, hidden // heads, tie,
                        qkv_bias=qkv_bias)


# name -> (description, shape), from each model's config.json on the Hugging Face hub.
PRESETS: dict[str, tuple[str, DecoderShape]] = {
    "gpt2-124m": ("GPT-2 small (vocab 50257, 1024 positions, hidden 768, 12 layers, tied head)",
                  DecoderShape("gpt2", 50257, 768, 12, 3072, 12, 12, 64, True, max_positions=1024)),
    "qwen2.5-0.5b": ("Qwen2.5-0.5B (vocab 151936, hidden 896, 24 layers, GQA 14/2, qkv bias, tied head)",
                     _llama_like("qwen2", 151936, 896, 24, 4864, 14, 2, True, qkv_bias=True)),
    "llama-3.2-1b": ("Llama-3.2-1B (vocab 128256, hidden 2048, 16 layers, GQA 32/8, tied head)",
                     _llama_like("llama", 128256, 2048, 16, 8192, 32, 8, True)),
    "llama-3.1-8b": ("Llama-3.1-8B (vocab 128256, hidden 4096, 32 layers, GQA 32/8, separate lm_head)",
                     _llama_like("llama", 128256, 4096, 32, 14336, 32, 8, False)),
    "qwen2.5-7b": ("Qwen2.5-7B (vocab 152064, hidden 3584, 28 layers, GQA 28/4, qkv bias, separate lm_head)",
                   _llama_like("qwen2", 152064, 3584, 28, 18944, 28, 4, False, qkv_bias=True)),
    "mistral-7b": ("Mistral-7B-v0.1 (vocab 32000, hidden 4096, 32 layers, GQA 32/8, separate lm_head)",
                   _llama_like("mistral", 32000, 4096, 32, 14336, 32, 8, False)),
}


def from_hf_config(path: str) -> DecoderShape:
    """The shape of the model a Hugging Face config.json (or the folder holding
    it) describes; refuses model types outside SUPPORTED_MODEL_TYPES."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as file:
        config = json.load(file)
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{path}: model_type {model_type!r} is not supported; the planner knows the dense decoders "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)} (not mixture-of-experts models such as mixtral or "
                         "qwen2_moe); plan one of those, or a preset")

    def read(key: str, default=None):
        value = config.get(key, default)
        if value is None:
            raise ValueError(f"{path}: a {model_type} config.json needs {key!r}, which is missing")
        return value

    if model_type == "gpt2":
        hidden = read("n_embd")
        return DecoderShape("gpt2", read("vocab_size"), hidden, read("n_layer"), config.get("n_inner") or 4 * hidden,
                            read("n_head"), read("n_head"), hidden // read("n_head"),
                            config.get("tie_word_embeddings", True), max_positions=read("n_positions"))
    hidden, heads = read("hidden_size"), read("num_attention_heads")
    attention_bias = model_type == "llama" and config.get("attention_bias", False)
    return DecoderShape(model_type, read("vocab_size"), hidden, read("num_hidden_layers"), read("intermediate_size"),
                        heads, config.get("num_key_value_heads") or heads, config.get("head_dim") or hidden // heads,
                        # transformers' default for all three is untied.
                        config.get("tie_word_embeddings", False),
                        qkv_bias=model_type == "qwen2" or attention_bias, o_bias=attention_bias,
                        mlp_bias=model_type == "llama" and config.get("mlp_bias", False))
