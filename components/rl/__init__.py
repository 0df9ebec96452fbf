"""Online RL's bookkeeping (recipe `grpo`): group-relative advantages, which groups train, and the off-policy
statistics a round records. The objective itself is TRL's (components/training/grpo.py)."""
