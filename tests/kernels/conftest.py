"""The kernel tests run on two threads even where the suite gives each worker one core
(tests/conftest.py): the kernels split rows and heads between threads, and those splits are
what a one-thread run would leave untested."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)
