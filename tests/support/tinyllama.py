"""A tiny Llama (rotary positions, grouped-query attention) with random weights, saved
beside a tiny GPT-2's tokenizer and loaded as any user's model folder is: what the
continuous-decoding tests check rotary models with."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from workers.models.hf import Generator


def tiny_llama(gpt2: Generator, folder: Path) -> Generator:
    """The tiny Llama, made in ``folder`` with ``gpt2``'s vocabulary and tokenizer."""
    torch.manual_seed(0)
    tokenizer = gpt2.tokenizer
    config = LlamaConfig(
        vocab_size=gpt2.model.config.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        # Weights large enough that attention, and so the rotary positions, decide tokens.
        initializer_range=0.5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Generator(model=str(folder), device="cpu", cache_dir=str(folder))
