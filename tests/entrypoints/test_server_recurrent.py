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


def test_group_gauges_while_a_request_holds_blocks(model_dir):
    """While a request holds blocks, every group's gauge shows its own: the attention group the
    request's rows, each state group its state blocks; the dashboard's data lists the same groups,
    within the pool's count. Read from the engine between two steps, where the request is known to
    hold its blocks (over HTTP a small model's stream could end before the scrape), through the
    server's own metrics and dashboard code; aborted, every group's gauge is back to 0."""
    from pagellm.entrypoints.openai.dashboard import build_state
    from pagellm.entrypoints.openai.metrics import ServerMetrics

    llm = LLM(model_dir, num_kv_blocks=64, block_size=4, dtype="float32")
    engine = llm.engine
    engine.add_request("held", {"prompt_token_ids": list(range(50, 90))},
                       SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True))
    engine.step()  # the prefill: the first token
    engine.step()  # a decode: the request runs on, holding its blocks
    metrics = ServerMetrics(NAME)
    stats = engine.stats()
    metrics.bind(lambda: stats)
    held_metrics = metrics.render().decode()
    held = build_state(engine.kv_snapshot(), stats, metrics, NAME, 0)
    labels = {"model_name": NAME}
    assert metric_value(held_metrics, "pagellm:num_requests_running", **labels) == 1
    groups = held["stats"]["kv_groups"]
    assert [g["kind"] for g in groups] == ["full", "state", "state"]
    assert sum(g["used_blocks"] for g in groups) <= held["stats"]["used_blocks"]
    gauges = [metric_value(held_metrics, "pagellm:kv_cache_group_used_blocks", group=str(i), kind=g["kind"],
                           window="none", **labels) for i, g in enumerate(groups)]
    assert gauges == [g["used_blocks"] for g in groups]
    assert gauges[0] >= 10 and gauges[1] > 0 and gauges[1] == gauges[2], gauges  # 40 prompt tokens: 10 blocks

    engine.abort_request("held")
    engine.step()  # the checkpoint blocks stay pinned until the step that copies into them
    stats = engine.stats()
    freed = metrics.render().decode()
    assert [metric_value(freed, "pagellm:kv_cache_group_used_blocks", group=str(i), **labels)
            for i in range(len(groups))] == [0, 0, 0]
