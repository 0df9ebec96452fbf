"""Seeds derived from (experiment seed, round, stage, shard), so any stage can be rerun alone."""

from __future__ import annotations

import hashlib
import random

import numpy as np


def derive_seed(experiment_seed: int, round: int, stage: str, shard: int = 0) -> int:
    """A 31-bit seed that depends only on its inputs (not on run order or attempt).

    >>> derive_seed(0, 1, "generate") == derive_seed(0, 1, "generate")
    True
    >>> derive_seed(0, 1, "generate") != derive_seed(0, 2, "generate")
    True
    """
    key = f"{experiment_seed}|{round}|{stage}|{shard}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:4], "big") & 0x7FFFFFFF


def seed_stream(seed: int, *keys: int) -> int:
    """A 31-bit seed per (seed, keys), for the streams inside one stage: a batch, a prompt, a wave.

    Hashing keeps seed s, key 1 apart from seed s+1, key 0, so two calls with neighbouring seeds
    (greedy eval at s, sampling at s+1) share no noise. It hashes otherwise than `derive_seed`
    (separator, byte order), and both stay as they are: stored samples were drawn from their values.

    >>> seed_stream(0, 1) == seed_stream(1, 0), seed_stream(0, 1) == seed_stream(0, 1)
    (False, True)
    """
    digest = hashlib.sha256(":".join(map(str, (seed, *keys))).encode()).digest()
    return int.from_bytes(digest[:4], "little") >> 1


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    try:
        import torch
    except ImportError:
        return
    torch.manual_seed(seed)
