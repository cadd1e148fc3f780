"""The command line's edges, met before any model loads: clear one-line errors, no tracebacks."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from pagellm import __version__
from pagellm.config import bytes_or_fraction
from pagellm.cli import build_parser


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagellm", *args], capture_output=True, text=True, timeout=120)


def test_version():
    r = run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"pagellm {__version__}"


@pytest.mark.parametrize("text, value", [("512M", 512 << 20), ("4G", 4 << 30), ("2GiB", 2 << 30), ("0.5", 0.5),
                                         ("1", 1.0), ("1073741824", 1 << 30)])
def test_kv_cache_memory_forms(text, value):
    assert bytes_or_fraction(text) == value


@pytest.mark.parametrize("text", ["lots", "2.5", ""])
def test_kv_cache_memory_refusals_say_the_forms(text):
    r = run("generate", "--kv-cache-memory", text, "--prompt", "x")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "byte count (e.g. 512M, 4G" in r.stderr and "fraction of free memory" in r.stderr
    assert "_bytes_or_fraction" not in r.stderr


def test_kv_budget_beyond_the_machine_is_refused_before_allocating():
    r = run("generate", "--kv-cache-memory", "100T", "--prompt", "x", "--max-tokens", "1")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "kv_cache_memory=109951162777600 asks for a KV cache of " in r.stderr
    assert "available beside the weights (MemAvailable)" in r.stderr


def test_serve_checks_its_address_before_loading_the_model():
    r = run("serve", "--port", "99999")
    assert r.returncode == 2 and "--port must be in [1, 65535], got 99999" in r.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = run("serve", "--port", str(s.getsockname()[1]))
    assert r.returncode == 2 and "cannot listen on 127.0.0.1" in r.stderr and "in use" in r.stderr
    assert "Traceback" not in r.stderr and "serving" not in r.stderr  # refused before the model loaded


def test_serve_takes_the_model_positionally():
    args = build_parser().parse_args(["serve", "some/model.gguf"])
    assert args.model_tag == "some/model.gguf"
    r = run("serve", "a.gguf", "--model", "b.gguf")
    assert r.returncode == 2 and "given twice" in r.stderr
