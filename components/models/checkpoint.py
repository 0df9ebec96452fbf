"""Where a given model's files are, and whether they make a usable policy: weights, config and a tokenizer.

    path = resolve_checkpoint("Qwen/Qwen2.5-0.5B-Instruct")   # the local HF cache's snapshot, offline
    path = resolve_checkpoint("workdir/standin")               # a local folder, checked

A run that starts from a model fails here, naming the model and what is missing, before any stage
commits: a folder without a tokenizer would otherwise fail deep inside a trainer.
"""

from __future__ import annotations

from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def resolve_checkpoint(name_or_path: str) -> Path:
    """The folder holding the model's files: a local folder as given, or a hub name's cached snapshot."""
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        if path.exists() or name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") != 1:
            raise FileNotFoundError(f"policy.model {name_or_path!r}: no such model folder (nor a hub name 'org/name')")
        from huggingface_hub import snapshot_download

        try:
            path = Path(snapshot_download(name_or_path, local_files_only=True))
        except Exception as e:  # noqa: BLE001 - any miss: not cached, offline, gated
            raise FileNotFoundError(f"policy.model {name_or_path!r}: not a local folder and not in the local HF cache "
                                    f"({type(e).__name__}); download it first (`hf download {name_or_path}`)") from e
    check_checkpoint(path, name_or_path)
    return path


def model_uri(name_or_path: str) -> str:
    """How a run names a model to stages that may run elsewhere: a local folder by its absolute path, a hub name
    as given."""
    path = Path(name_or_path).expanduser()
    return str(path.resolve()) if path.is_dir() else name_or_path


def check_checkpoint(path: Path, name: str | None = None) -> None:
    """Raise naming the model and the missing part: config.json, weights, or a tokenizer."""
    what = f"policy.model {name or str(path)!r} ({path})" if name and name != str(path) else f"model folder {path}"
    files = {p.name for p in path.iterdir()}
    missing = []
    if "config.json" not in files and "adapter_config.json" not in files:
        missing.append("config.json")
    if not any(f.endswith(WEIGHT_SUFFIXES) for f in files):
        missing.append("weights (*.safetensors)")
    if not files & set(TOKENIZER_FILES):
        missing.append(f"a tokenizer (one of {', '.join(TOKENIZER_FILES)})")
    if missing:
        raise FileNotFoundError(f"{what} is missing {' and '.join(missing)}: save the model with "
                                "model.save_pretrained(dir) and its tokenizer with tokenizer.save_pretrained(dir)")
