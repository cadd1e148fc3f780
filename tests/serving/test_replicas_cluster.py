"""`pagellm serve --ray-address`: replicas join a Ray cluster started apart from pagellm (`ray start
--head`, as on the first machine of a real cluster), each replica itself on two tensor-parallel
ranks. Completions equal one engine's, and stopping the server leaves the cluster running
(pagellm did not start it)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from pagellm import LLM, SamplingParams
from tests.entrypoints.server_utils import RemoteServer, free_port

PROMPTS = ["You answer questions about rivers. Which is longest?", "You write short letters. Dear Ann,"]


def _ray(*args: str, env: dict) -> subprocess.CompletedProcess:
    ray = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
    return subprocess.run([ray, *args], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # a Ray cluster started by its CLI; replicas and TP each keep fast tests of their own
def test_serve_joins_a_running_cluster_with_tensor_parallel_replicas(tiny_llama_dir):
    want = [o.outputs[0].text for o in LLM(tiny_llama_dir, block_size=4, num_kv_blocks=64).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)]
    port = free_port()
    # Ray >= 2.59's `ray start` authenticates with a token; whoever joins must use the same mode.
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    started = _ray("start", "--head", "--port", str(port), "--num-cpus", "2", "--disable-usage-stats", env=env)
    assert started.returncode == 0, started.stderr[-2000:]
    try:
        server = RemoteServer(["--model", tiny_llama_dir, "--served-model-name", "m", "--block-size", "4",
                               "--num-kv-blocks", "64", "--data-parallel-size", "2", "--tensor-parallel-size", "2",
                               "--ray-address", f"127.0.0.1:{port}"], env={"RAY_AUTH_MODE": "token"})
        try:
            client = server.client()
            got = [client.completions.create(model="m", prompt=p, max_tokens=8, temperature=0).choices[0].text
                   for p in PROMPTS]
        finally:
            server.close()
        assert got == want
        assert _ray("status", "--address", f"127.0.0.1:{port}", env=env).returncode == 0  # still up
    finally:
        _ray("stop", "--force", env=env)
