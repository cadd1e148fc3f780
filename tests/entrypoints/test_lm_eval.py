"""lm-evaluation-harness as a real client of the server: its loglikelihood requests (echo,
logprobs, max_tokens 0) and its generate_until requests, on the tasks in
benchmarks/lm_eval_tasks/ (a local JSON file; nothing from a hub)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from server_utils import MODEL_NAME

TASKS = Path(__file__).resolve().parents[2] / "benchmarks" / "lm_eval_tasks"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    """lm-eval counts context tokens itself: the model's own tokenizer, read out of the GGUF."""
    from transformers import AutoTokenizer

    from pagellm.loader.bundled import default_model_path

    path, out = default_model_path(), tmp_path_factory.mktemp("tokenizer")
    AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path)).save_pretrained(out)
    return str(out)


def test_lm_eval_scores_both_task_kinds(smollm2_server, tokenizer_dir, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(TASKS)  # the tasks' data_files are relative to their folder
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model={MODEL_NAME},base_url={smollm2_server.url}/v1/completions,tokenizer={tokenizer_dir},"
                   f"tokenized_requests=True,num_concurrent=2,max_retries=1",
        tasks=["pagellm_capitals_mc", "pagellm_capitals_gen"], task_manager=TaskManager(include_path=str(TASKS)),
        limit=8)["results"]
    # Chance is 0.25 for four choices; a broken echo or offset scores the wrong tokens.
    assert results["pagellm_capitals_mc"]["acc,none"] >= 0.75
    assert results["pagellm_capitals_gen"]["exact_match,strip"] >= 0.5
