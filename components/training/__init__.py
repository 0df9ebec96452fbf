"""Policy training with TRL: `sft.train_sft(model_path, examples, out_dir, SFTParams(...))`."""
