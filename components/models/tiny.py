"""A from-scratch tiny Llama, saved in Hugging Face format, and a loader for any HF model.

    path = create_tiny_llama(TinyLlamaConfig(), "workdir/init", seed=0)
    model, tok = load_policy(path)          # or load_policy("Qwen/Qwen2.5-0.5B")

The tiny model is a plain `LlamaForCausalLM` over the character vocabulary, so everything downstream
(TRL, generate, vLLM) treats it exactly like a real checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

from components.models.tokenizer import build_char_tokenizer
from components.training.common import torch_dtype
from components.training.lora import load_causal_lm


@dataclass
class TinyLlamaConfig:
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 384         # SwiGLU width, 3x hidden
    max_position_embeddings: int = 256   # tokens; a level-6 arithmetic chain is under 100

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must be divisible by num_heads {self.num_heads}")


def create_tiny_llama(cfg: TinyLlamaConfig, out_dir: str | Path, seed: int) -> Path:
    """Randomly initialise a Llama over the char vocabulary; save weights (safetensors), tokenizer and
    generation config to `out_dir`. About 0.87M parameters with the defaults."""
    out = Path(out_dir)
    tok = build_char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.max_position_embeddings,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        tie_word_embeddings=True,  # with a 100-token vocab an untied head would only add parameters
    )
    torch.manual_seed(seed)  # the init is all torch RNG
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def _looks_local(name: str) -> bool:
    # A hub id is "name" or "org/name"; anything with a path prefix or more than one "/" is a path.
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or Path(name).exists()


def load_policy(name_or_path: str | Path, device: str = "cpu", dtype: torch.dtype | str | None = None):
    """(model, tokenizer) for any HF model name or local path, in eval mode, padded left for generation.

    A local path that does not exist fails here, with that path, rather than as a hub lookup error.
    `dtype` None means float32 (CPU-safe); "bfloat16", "float16" (CUDA only) or "auto" (the checkpoint's
    own). A LoRA adapter folder (adapter_config.json, as `train_sft` writes with `lora.merge=False`) loads
    as its base with the adapter merged in, and the folder's tokenizer and generation config.
    """
    name = str(name_or_path)
    if _looks_local(name) and not Path(name).expanduser().exists():
        raise FileNotFoundError(f"policy model path not found: {name}")
    if name.startswith("~"):
        name = str(Path(name).expanduser())
    tok = AutoTokenizer.from_pretrained(name)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"  # decoder-only generation continues from the right edge
    model = load_causal_lm(name, torch_dtype(dtype) if isinstance(dtype, str) else dtype or torch.float32)
    if model.dtype == torch.float16 and not str(device).startswith("cuda"):  # "auto" may find fp16 weights too
        raise ValueError(f"{name}: float16 weights need a CUDA device, not {device!r}; load with dtype bfloat16 "
                         "or float32")
    model.to(device).eval()
    return model, tok
