"""Shared by the tests that run tiny models end to end: bert.py's main, one torch thread."""
import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def bert_script():
    """bert.py as a module (the script cannot be imported by name: the package bert/ shadows it)."""
    spec = importlib.util.spec_from_file_location("bert_cli", ROOT / "bert.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bert_cli():
    """bert.py's main."""
    return bert_script().main


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny models on a shared 2-core machine: one thread is several times faster than two.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
