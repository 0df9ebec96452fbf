"""Policy models: a from-scratch tiny Llama with a character tokenizer, and generation backends."""
