"""Fixtures for the server tests: one SmolLM2 server process shared by the modules that need it."""
from __future__ import annotations

import pytest

from server_utils import RemoteServer


@pytest.fixture(scope="session")
def smollm2_server():
    """The bundled SmolLM2 with a small KV pool (91 blocks), shared by the server test modules. Prompt
    lookup is on: every server test's output must be what plain decoding gives (it is lossless).
    /score and /rerank use it as a yes/no reranker."""
    server = RemoteServer(["--kv-cache-memory", "64M", "--max-model-len", "2048",
                           "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                           "--classifier-from-token", '["no", "yes"]',
                           "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])
    yield server
    server.close()
