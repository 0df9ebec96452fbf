"""Policy training with TRL (SFT; DPO and GRPO share the same shape)."""
