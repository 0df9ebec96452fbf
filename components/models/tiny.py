"""A from-scratch tiny Llama, saved in Hugging Face format, and a loader for any HF model.

    path = create_tiny_llama(TinyLlamaConfig(), "workdir/init", seed=0)
    model, tok = load_policy(path)          # or load_policy("Qwen/Qwen2.5-0.5B")
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

from components.models.tokenizer import build_char_tokenizer


@dataclass
class TinyLlamaConfig:
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 384
    max_position_embeddings: int = 256  # tokens; arithmetic chains stay far below


def create_tiny_llama(cfg: TinyLlamaConfig, out_dir: str | Path, seed: int) -> Path:
    """Randomly initialise a Llama over the char vocabulary and save it (safetensors) with its tokenizer."""
    out = Path(out_dir)
    tok = build_char_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.max_position_embeddings,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        tie_word_embeddings=True, rope_theta=10000.0,
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / "coevo_tiny.json").write_text(str(asdict(cfg)))
    return out


def _is_local(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or Path(name).exists()


def load_policy(name_or_path: str, device: str = "cpu", dtype: torch.dtype | None = None):
    """Any HF model name or local path; a local path that does not exist fails with that path."""
    if _is_local(name_or_path) and not Path(name_or_path).expanduser().exists():
        raise FileNotFoundError(f"policy model path not found: {name_or_path}")
    tok = AutoTokenizer.from_pretrained(name_or_path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"  # decoder-only generation pads on the left
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype or torch.float32)
    model.to(device).eval()
    return model, tok
