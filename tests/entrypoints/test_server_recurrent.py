"""A recurrent model (Qwen3.5's Gated DeltaNet layers) served over HTTP as a user would: the
completions of a prompt equal the Python API's, a second prompt extending the first resumes from
a state checkpoint, and /metrics, the stats and the block map report the state group."""
from __future__ import annotations

import httpx
import pytest

from pagellm import LLM, SamplingParams
from tests.entrypoints.server_utils import RemoteServer, metric_value
from tests.models.families import build

NAME = "qwen3_5-test"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build("qwen3_5", tmp_path_factory.mktemp("qwen3_5")))


def test_served_recurrent_model_resumes_a_prefix_from_its_checkpoint(model_dir):
    first = list(range(3, 40))
    second = first + [41, 42, 43]
    args = ["--model", model_dir, "--served-model-name", NAME, "--num-kv-blocks", "64", "--block-size", "4",
            "--dtype", "float32"]
    server = RemoteServer(args)
    try:
        client = server.client()
        got = [client.completions.create(model=NAME, prompt=p, max_tokens=6, temperature=0).choices[0].text
               for p in (first, second)]
        stats = server.wait_all_blocks_free()["stats"]
        metrics = httpx.get(server.url + "/metrics").text
    finally:
        server.close()
    llm = LLM(model_dir, num_kv_blocks=64, block_size=4, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    want = [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": p} for p in (first, second)], params,
                                                    use_tqdm=False)]
    assert got == want
    state = [g for g in stats["kv_groups"] if g["kind"] == "state"]
    assert len(state) == 2 and state[0]["checkpoints_restored"] == 1 and state[0]["checkpoints_taken"] >= 1
    assert stats["prefix_cache_hits"] == 36  # 9 blocks of 4: the last boundary before the first prompt's end
    labels = {"model_name": NAME}
    assert metric_value(metrics, "pagellm:state_checkpoints_restored_total", **labels) == 1
    assert metric_value(metrics, "pagellm:kv_cache_group_used_blocks", kind="state", **labels) == 0
