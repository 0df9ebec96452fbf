"""LoRA (Hu et al. 2021) through peft, for any trainer here: the settings, the checks, loading and saving.

    params = SFTParams(lora=LoraParams(r=8, alpha=16, target_modules="all-linear", merge=True))
    peft_config = lora_config(params.lora, model, where="train_policy.lora")   # handed to the TRL trainer
    save_lora(trainer.model, tok, "out/model", params.lora, base="workdir/.../model")
    model = load_causal_lm("out/model", torch.float32)   # a plain model, an adapter merged in if it is one

TRL wraps the model with the config (`peft_config=`), so only the adapters train and DPO's reference is
the base with the adapters switched off. On save, `merge=True` folds the adapters into the weights and
writes an ordinary checkpoint (HF and vLLM load it); `merge=False` writes only the adapter, with
adapter_config.json naming its base by absolute path, plus the tokenizer and generation config, and
`load_causal_lm` (under `load_policy` and `load_for_training`) loads the base and merges the adapter in,
following a chain of adapter folders back to a full checkpoint.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from components.models.checkpoint import model_uri

ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class LoraParams:
    r: int = 8                                   # adapter rank
    alpha: float = 16                            # scale: the update is (alpha / r) * B @ A
    dropout: float = 0.0                         # on the adapter's input; 0 keeps CPU runs deterministic
    target_modules: str | tuple[str, ...] = "all-linear"  # "all-linear" (every Linear but the output head), a
    #                                              list of module names (q_proj, ...), or a regex over full names
    merge: bool = True                           # save merged weights (a plain checkpoint); False: the adapter only
    modules_to_save: tuple[str, ...] = field(default=())  # trained in full beside the adapters, e.g. a reward head

    def __post_init__(self) -> None:
        # Lists arrive from YAML; tuples keep the params hashable and printable.
        for name in ("target_modules", "modules_to_save"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        if self.r < 1:
            raise ValueError(f"LoraParams.r must be >= 1, got {self.r}")
        if not self.alpha > 0:
            raise ValueError(f"LoraParams.alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoraParams.dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ValueError("LoraParams.target_modules is empty: give 'all-linear' or module names such as q_proj")

    @classmethod
    def of(cls, value: LoraParams | dict[str, Any] | None) -> LoraParams | None:
        """From LoraParams, a dict (as a config section carries it), or None (no LoRA)."""
        if value is None or isinstance(value, LoraParams):
            return value
        return cls(**value)


def linear_module_names(model: Any) -> list[str]:
    """Full names of the model's Linear layers (what LoRA can adapt)."""
    import torch

    return [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def lora_config(params: LoraParams, model: Any, where: str = "lora", task_type: str = "CAUSAL_LM"):
    """peft LoraConfig for `model`; a target module that matches none of its layers is a ValueError naming the
    architecture and the linear modules it has (peft would only say 'not found', and only when all miss)."""
    from peft import LoraConfig

    names = [name for name, _ in model.named_modules() if name]
    targets = params.target_modules
    if targets != "all-linear":
        if isinstance(targets, str):  # peft reads any other string as a regex over full module names
            missing = [] if any(re.fullmatch(targets, n) for n in names) else [targets]
        else:
            missing = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]
        if missing:
            arch = f"{type(model).__name__} ({getattr(model.config, 'model_type', '?')})"
            have = sorted({n.rsplit(".", 1)[-1] for n in linear_module_names(model)})
            raise ValueError(f"{where}.target_modules {missing} match no module of {arch}; its linear modules are "
                             f"{', '.join(have)} (or use 'all-linear')")
    return LoraConfig(r=params.r, lora_alpha=params.alpha, lora_dropout=params.dropout,
                      target_modules=targets if isinstance(targets, str) else list(targets),
                      modules_to_save=list(params.modules_to_save) or None, task_type=task_type, bias="none")


def is_adapter_dir(name_or_path: str | Path) -> bool:
    return (Path(name_or_path).expanduser() / ADAPTER_CONFIG).is_file()


def load_causal_lm(name_or_path: str | Path, dtype: Any):
    """AutoModelForCausalLM for a checkpoint, or for an adapter folder its base with the adapter merged in
    (and the folder's generation config, which carries a chat-trained EOS)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    if not is_adapter_dir(name_or_path):
        return AutoModelForCausalLM.from_pretrained(str(name_or_path), dtype=dtype)
    from peft import PeftConfig, PeftModel

    path = Path(name_or_path).expanduser()
    base = PeftConfig.from_pretrained(str(path)).base_model_name_or_path
    if base is None or (base.startswith(("/", ".", "~")) and not Path(base).expanduser().exists()):
        raise FileNotFoundError(f"LoRA adapter {path}: its base model {base!r} (adapter_config.json "
                                "base_model_name_or_path) is missing")
    with warnings.catch_warnings():  # peft reads transformers' renamed `is_gradient_checkpointing`
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        model = PeftModel.from_pretrained(load_causal_lm(base, dtype), str(path)).merge_and_unload()
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(path))
    return model


def save_lora(peft_model: Any, tok: Any, out_dir: str | Path, params: LoraParams, base: str) -> None:
    """Merged weights as a plain checkpoint (`params.merge`), or the adapter naming `base`; tokenizer with both."""
    out = Path(out_dir)
    if params.merge:
        peft_model.merge_and_unload().save_pretrained(out)
    else:
        peft_model.peft_config["default"].base_model_name_or_path = model_uri(base)
        with warnings.catch_warnings():  # a base that is itself an adapter folder has no config.json to compare
            warnings.filterwarnings("ignore", message="Could not find a config file", category=UserWarning)
            peft_model.save_pretrained(out)
        peft_model.get_base_model().generation_config.save_pretrained(out)
    tok.save_pretrained(out)
