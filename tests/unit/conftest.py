from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def one_torch_thread():
    """1 intra-op thread: on a small shared CPU, 2 threads can be 10x slower when the cores are busy."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
