"""Policy models: a from-scratch tiny Llama with a character tokenizer, and generation backends.

    tokenizer.build_char_tokenizer()                     -> PreTrainedTokenizerFast
    tiny.create_tiny_llama(TinyLlamaConfig(), dir, seed) -> Path   (safetensors + tokenizer)
    tiny.load_policy(name_or_path)                       -> (model, tokenizer)
    backends.get_backend("hf" | "vllm" | "openai", model, **options).generate(...) -> list[list[Sample]]

Submodules are imported on use: torch and transformers load only where a model is needed.
"""
