"""Prefect tasks: one per stage, each a thin wrapper that launches the stage job and commits it."""
