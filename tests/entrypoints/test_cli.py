"""The `pagellm` command, run as a user would run it."""
from __future__ import annotations

import subprocess
import sys


def test_chat_answers_paris():
    proc = subprocess.run([sys.executable, "-m", "pagellm", "chat", "--max-tokens", "40", "--kv-cache-memory", "128M"],
                          input="What is the capital of France?\n", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_generate_prompts_from_stdin():
    proc = subprocess.run([sys.executable, "-m", "pagellm", "generate", "--max-tokens", "8", "--kv-cache-memory", "64M"],
                          input="The capital of France is\nThe capital of Germany is\n",
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout and "Berlin" in proc.stdout


def test_bad_option_is_a_clear_error(tiny_llama_dir):
    proc = subprocess.run([sys.executable, "-m", "pagellm", "generate", "--model", tiny_llama_dir,
                           "--prompt", "hello", "--temperature", "-1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "temperature" in proc.stderr and "Traceback" not in proc.stderr
