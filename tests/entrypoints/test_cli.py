"""The `pagellm` command, run as a user would run it."""
from __future__ import annotations

import subprocess
import sys


def test_generate_prompts_from_stdin():
    proc = subprocess.run([sys.executable, "-m", "pagellm", "generate", "--max-tokens", "8", "--kv-cache-memory", "64M"],
                          input="The capital of France is\nThe capital of Germany is\n",
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout and "Berlin" in proc.stdout
    # What loads and when it is ready go to stderr, not into the output.
    assert "pagellm: loading " in proc.stderr and "SmolLM2-135M-Instruct.Q4_1.gguf (gguf, llama family" in proc.stderr
    assert "pagellm: ready in " in proc.stderr and "pagellm:" not in proc.stdout


def test_bad_option_is_a_clear_error(tiny_llama_dir):
    for command in (["generate", "--prompt", "hello"], ["chat"]):
        proc = subprocess.run([sys.executable, "-m", "pagellm", *command, "--model", tiny_llama_dir,
                               "--temperature", "-1"], capture_output=True, text=True, timeout=300, input="")
        assert proc.returncode == 2
        assert "temperature" in proc.stderr and "Traceback" not in proc.stderr
        assert "pagellm: loading " not in proc.stderr  # refused before the model loads


def test_chat_commands():
    # Answers (Paris), the commands, and a message too long for the pool refused alone.
    script = "/help\nWhat is the capital of France?\n" + "very long " * 2000 + "\n/reset\n/exit\nnever read\n"
    proc = subprocess.run([sys.executable, "-m", "pagellm", "chat", "--max-tokens", "20", "--kv-cache-memory", "64M"],
                          input=script, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "/reset forget the conversation" in proc.stdout and "(conversation forgotten)" in proc.stdout
    assert "Paris" in proc.stdout
    assert "pagellm: " in proc.stderr and "KV blocks" in proc.stderr  # the long message, refused alone


def test_ctrl_c_stops_the_reply_not_the_chat():
    """In a terminal, Ctrl-C while a reply streams stops that reply and the prompt comes back."""
    import os
    import pty
    import select
    import signal
    import time

    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "pagellm", "chat", "--max-tokens", "1000", "--ignore-eos",
                             "--kv-cache-memory", "256M"], stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    seen = b""

    def read_until(marker: bytes, timeout: float) -> bytes:
        nonlocal seen
        deadline = time.time() + timeout
        while marker not in seen and time.time() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    seen += os.read(master, 4096)
                except OSError:
                    break
        return seen

    try:
        assert b"> " in read_until(b"> ", 240)
        os.write(master, b"Tell me a long story.\n")
        start = len(seen)
        deadline = time.time() + 120
        while len(seen) - start < 200 and time.time() < deadline:  # the reply is streaming
            read_until(b"\0", 0.5)
        proc.send_signal(signal.SIGINT)
        assert b"[stopped]" in read_until(b"[stopped]", 30)
        stopped = seen.index(b"[stopped]")
        deadline = time.time() + 30
        while b"> " not in seen[stopped:] and time.time() < deadline:
            read_until(b"\0", 0.5)
        assert b"> " in seen[stopped:]  # the prompt is back
        os.write(master, b"/exit\n")
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        os.close(master)
