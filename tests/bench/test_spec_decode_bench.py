"""`pagellm bench spec-decode`: both systems measured on every workload, outputs compared."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers
from tokenizers import processors

from pagellm.bench import spec_decode, spec_decode_peer
from pagellm.cli import main
from pagellm.envs import llama_cpp_bin
from pagellm.loader.gguf_loader import read_gguf_config
from pagellm.loader.synthetic import DEFAULT_CHAT_TEMPLATE as CHAT_TEMPLATE
from pagellm.loader.tokenizer import Tokenizer


def test_spec_decode_bench_tiny(tmp_path, tiny_llama_dir):
    """Each round has a code file, a document, a chat question and a module's record of its own, the
    same for both systems within the round; every run records its prompt's size and the start of its
    output; the JSON echo's outputs are JSON under its schema, with and without speculation."""
    stem = tmp_path / "spec"
    rc = main(["bench", "spec-decode", "--model", tiny_llama_dir, "--code-lines", "2", "--summary-lines", "3",
               "--max-tokens", "6", "--repeat", "2", "--out", str(stem)])
    assert rc == 0
    data = json.loads(stem.with_suffix(".json").read_text())
    assert data["benchmark"] == "spec-decode" and data["machine"]["cpu"] and len(data["load"]["loadavg_start"]) == 3
    assert list(data["workloads"]) == ["code-edit", "summary", "chat", "json-echo"]
    assert data["code_files"] == [f"pagellm/{f}" for f in spec_decode.CODE_FILES[:2]]
    assert data["summary_docs"] == ["docs/serving.md", "docs/kv-cache.md"]
    assert data["json_modules"] == [f"pagellm/{f}" for f in spec_decode.JSON_MODULES[:2]]
    sources = {"code-edit": data["code_files"], "summary": data["summary_docs"],
               "chat": list(spec_decode.CHAT_PROMPTS[:2]), "json-echo": data["json_modules"]}
    for system in ("plain", "speculative"):  # 6 tokens of the schema's object: its start, whatever the model
        assert all(r["text_head"].lstrip().startswith("{") for r in data["workloads"]["json-echo"][system]["runs"])
    for workload, entry in data["workloads"].items():
        assert entry["outputs_equal"] is True
        assert [r["source"] for r in entry["rounds"]] == sources[workload]
        assert len(set(sources[workload])) == 2
        for system in ("plain", "speculative"):
            runs = entry[system]["runs"]
            assert [r["source"] for r in runs] == sources[workload]
            assert [r["tokens"] for r in runs] == entry["output_tokens"] and all(r["loadavg"] for r in runs)
            assert [r["prompt_tokens"] for r in runs] == [r["prompt_tokens"]["pagellm"] for r in entry["rounds"]]
            assert all(isinstance(r["text_head"], str) and 0 < len(r["text_head"]) <= 200 for r in runs)
            assert entry[system]["decode_tokens_per_s"] > 0
        assert entry["speedup"] > 0
        # every run's decode steps by rows: the rows past the first are the proposals it verified
        for r in entry["speculative"]["runs"]:
            assert sum((int(rows) - 1) * e["steps"] for rows, e in r["decode_steps_by_rows"].items()) == r["draft_tokens"]
        assert entry["speculative"]["step_ms_by_rows"]["1"] > 0
        # A random model copies nothing, but its JSON's start may be the prompt's record's: proposed.
        steps = [r["steps"] for r in entry["lookup_replay"]["rounds"]]
        if workload == "json-echo":
            assert all(0 < s <= n - 1 for s, n in zip(steps, entry["output_tokens"]))
        else:
            assert steps == [n - 1 for n in entry["output_tokens"]]
    for name, entry in data["workloads"].items():  # other files, other questions: prompts of other sizes here
        sizes = sorted(r["prompt_tokens"]["pagellm"] for r in entry["rounds"])
        assert sizes[0] < sizes[1] and f"{name} ({sizes[0]} to {sizes[1]} prompt tokens)" in spec_decode.doc_table(data)


def test_each_round_edits_another_module_of_300_lines_or_more():
    """More rounds than distinct prompts would hand a proposer that remembers earlier requests the
    text it must write: refused, naming the limit."""
    sources = spec_decode.round_sources("code-edit", spec_decode.max_rounds())
    assert len(set(sources)) == len(sources) == len(spec_decode.CODE_FILES)
    for source in sources:
        assert len((spec_decode.PACKAGE.parent / source).read_text().splitlines()) >= 300
        prompt = spec_decode.code_edit_prompt(spec_decode.PACKAGE.parent / source, 300)
        name = prompt.split("rename the function `")[1].split("`")[0]
        assert f"def {name}(" in prompt and not name.startswith("_")
    with pytest.raises(ValueError, match=f"--repeat must be between 1 and {spec_decode.max_rounds()}"):
        spec_decode.round_sources("chat", spec_decode.max_rounds() + 1)


def test_each_round_summarizes_another_page_that_fits_the_context(smollm2_gguf):
    """Every round's document is another docs page with 160 lines of prose or more, all of them in
    the prompt with the instruction to quote it verbatim; with the bundled model's tokenizer each
    prompt is about the code edit's size and leaves room in its context for 256 output tokens."""
    sources = spec_decode.round_sources("summary", spec_decode.max_rounds())
    assert len(set(sources)) == len(sources) == len(spec_decode.SUMMARY_DOCS) == spec_decode.max_rounds()
    tok = Tokenizer.from_gguf(smollm2_gguf)
    context = read_gguf_config(smollm2_gguf).max_position_embeddings
    cfg = spec_decode.SpecBenchConfig()
    sizes = []
    for source in sources:
        prose = spec_decode.document_prose(spec_decode.REPOSITORY / source)
        assert len(prose) >= cfg.summary_lines
        message = spec_decode.user_message("summary", source, cfg)
        document = message.split("<document>\n")[1].split("\n</document>")[0]
        assert document == "\n".join(prose[:cfg.summary_lines]).strip()
        assert "word for word" in message
        prompt = spec_decode.render_prompt(tok, message, source)
        sizes.append(len(prompt.token_ids))
        spec_decode.check_fits({"summary": [prompt]}, cfg.max_tokens, context)
    # about the code edit's size: no shorter than 3/4 of its shortest, no longer than its longest
    code = [len(spec_decode.render_prompt(tok, spec_decode.user_message("code-edit", source, cfg), source).token_ids)
            for source in spec_decode.round_sources("code-edit", spec_decode.max_rounds())]
    assert 0.75 * min(code) <= min(sizes) and max(sizes) <= max(code), (sizes, code)


def test_the_document_is_the_pages_prose(tmp_path):
    """Code blocks, tables and comments (a generated table's markers) are cut from the page; the
    blank lines they leave merge into one."""
    page = tmp_path / "page.md"
    page.write_text("# Title\n\nA sentence.\n\n```python\nx = 1\n```\n\n| a | b |\n|---|---|\n\n"
                    "<!-- marker: generated\nacross lines -->\nThe last sentence.\n")
    assert spec_decode.document_prose(page) == ["# Title", "", "A sentence.", "", "The last sentence."]
    with pytest.raises(ValueError, match="document .*none.md is missing .*leave summary out of --workloads"):
        spec_decode.document_prose(tmp_path / "none.md")


def test_a_prompt_the_context_cannot_hold_with_its_output_is_refused(tmp_path, tiny_llama_dir, capsys):
    """The tiny model's 512 tokens cannot hold a summary's document: refused before any run, naming
    the round's source, the sizes and the limit (the engine would cut the output short)."""
    assert main(["bench", "spec-decode", "--model", tiny_llama_dir, "--workloads", "summary", "--repeat", "1",
                 "--out", str(tmp_path / "a")]) != 0
    err = capsys.readouterr().err
    assert "summary prompt of docs/serving.md: " in err and "--max-tokens 256 exceed the model's context of 512" in err
    assert not (tmp_path / "a.json").exists()
    assert main(["bench", "spec-decode", "--model", tiny_llama_dir, "--workloads", "summary,poem",
                 "--out", str(tmp_path / "b")]) != 0
    assert "unknown poem; choose from code-edit, summary, chat" in capsys.readouterr().err


def test_llama_server_is_sent_the_text_pagellm_reads(smollm2_gguf):
    """The prompt is rendered once, with pagellm's tokenizer; the body for llama-server's raw
    completion endpoint carries that text, which its tokenizer (the GGUF's: no BOS added for
    SmolLM2) reads as the same tokens."""
    tok = Tokenizer.from_gguf(smollm2_gguf)
    prompt = spec_decode.render_prompt(tok, spec_decode.CHAT_PROMPTS[0], spec_decode.CHAT_PROMPTS[0])
    assert prompt.text.startswith("<|im_start|>system") and spec_decode.CHAT_PROMPTS[0] in prompt.text
    assert prompt.token_ids == tok.encode(prompt.text, add_special_tokens=False)
    body = spec_decode_peer.request_body(prompt.peer_text, 16)
    assert body == {"prompt": prompt.text, "n_predict": 16, "temperature": 0.0, "seed": 0, "stream": False}
    assert tok.encode(body["prompt"], add_special_tokens=True) == prompt.token_ids


def test_a_bos_the_template_writes_is_not_sent_twice(tiny_llama_dir):
    """A model whose tokenizer adds a BOS and whose template writes one too: the server adds its
    own, so the text sent starts after the template's."""
    backend = tokenizers.Tokenizer.from_file(str(Path(tiny_llama_dir) / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok = Tokenizer(backend, special_tokens={"bos_token": "<s>", "eos_token": "</s>"},
                    chat_template="{{ bos_token }}" + CHAT_TEMPLATE)
    prompt = spec_decode.render_prompt(tok, "hi", "hi")
    assert prompt.token_ids[0] == 0 and prompt.token_ids.count(0) == 1
    assert prompt.peer_text == prompt.text[len("<s>"):]
    assert tok.encode(prompt.peer_text, add_special_tokens=True) == prompt.token_ids
    assert spec_decode_peer.completion_prompt("no bos here", "<s>") == "no bos here"


def test_the_llama_server_peer_is_refused_where_it_cannot_run(tmp_path, tiny_llama_dir, capsys):
    """An unknown --spec-type is named before anything loads; an HF folder has no file for llama-server."""
    assert main(["bench", "spec-decode", "--model", tiny_llama_dir, "--peer", "none,ngram-fancy",
                 "--out", str(tmp_path / "a")]) != 0
    assert "unknown llama-server --spec-type ngram-fancy" in capsys.readouterr().err
    assert main(["bench", "spec-decode", "--model", tiny_llama_dir, "--peer", "--code-lines", "2", "--max-tokens", "4",
                 "--repeat", "1", "--out", str(tmp_path / "b")]) != 0
    assert "llama-server serves GGUF files" in capsys.readouterr().err


def test_spec_decode_bench_with_a_draft_model(tmp_path, tiny_llama_dir):
    """--method draft_model with the target as its own draft: every proposal accepted, same output."""
    stem = tmp_path / "spec"
    rc = main(["bench", "spec-decode", "--model", tiny_llama_dir, "--method", "draft_model", "--draft-model",
               tiny_llama_dir, "--workloads", "chat", "--max-tokens", "6", "--repeat", "1", "--kv-cache-dtype", "int8",
               "--out", str(stem)])
    assert rc == 0
    data = json.loads(stem.with_suffix(".json").read_text())
    assert data["config"]["speculative_config"]["method"] == "draft_model"
    assert data["config"]["quantization"] == "auto" and data["config"]["kv_cache_dtype"] == "int8"
    entry = data["workloads"]["chat"]
    assert entry["outputs_equal"] is True and entry["speculative"]["acceptance_rate"] == 1.0


@pytest.mark.slow
def test_llama_server_reads_the_same_prompt_tokens(tmp_path, smollm2_gguf):
    """With the real llama-server: the ids it reads for each round's text are pagellm's, it
    reports as many prompt tokens (no second BOS), and its runs follow the rounds' sources."""
    binary = Path(llama_cpp_bin()) / "llama-server"
    if not binary.exists():
        pytest.skip(f"{binary} is not built (benchmarks/build_llama_cpp.sh)")
    stem = tmp_path / "spec"
    assert main(["bench", "spec-decode", "--model", smollm2_gguf, "--peer", "none", "--code-lines", "20",
                 "--summary-lines", "20", "--max-tokens", "4", "--repeat", "2", "--out", str(stem)]) == 0
    data = json.loads(stem.with_suffix(".json").read_text())
    for entry in data["workloads"].values():
        assert entry["same_prompt_tokens"] is True
        runs = entry["llama-server"]["none"]["runs"]
        assert [r["source"] for r in runs] == [r["source"] for r in entry["rounds"]]
        assert [r["prompt_tokens"] for r in runs] == [r["prompt_tokens"]["pagellm"] for r in entry["rounds"]]
        assert all(r["text_head"] for r in runs)
    # Held to the record's schema there too (its json_schema): its output opens the object.
    assert all(r["text_head"].lstrip().startswith("{")
               for r in data["workloads"]["json-echo"]["llama-server"]["none"]["runs"])


def test_lookup_replay_counts_the_steps_a_copy_saves():
    """Every step emits its accepted proposals and one token of its own; an output copied from the
    prompt needs far fewer steps than tokens, one that repeats nothing needs one per token."""
    spec = spec_decode.SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4})
    prompt = list(range(100, 200))
    copy = spec_decode.lookup_replay(prompt, prompt[10:60], spec)
    # (the last step's own token may fall past the end)
    assert 49 <= copy["steps"] + copy["accepted_tokens"] <= 50 and copy["ceiling"] == 49 / copy["steps"]
    assert copy["ceiling"] > 3 and copy["accepted_tokens"] <= copy["draft_tokens"]
    fresh = spec_decode.lookup_replay(prompt, list(range(300, 350)), spec)
    assert fresh == {"steps": 49, "draft_tokens": 0, "accepted_tokens": 0, "ceiling": 1.0}


def test_lookup_replay_proposes_and_keeps_what_the_engine_did(smollm2_gguf):
    """Replayed over the plain run's output, prompt lookup drafts and keeps exactly the tokens the
    engine drafted and kept speculating on the same prompt (the bundled model repeats itself)."""
    from pagellm.entrypoints.llm import LLM
    from pagellm.sampling_params import SamplingParams

    options = {"method": "ngram", "num_speculative_tokens": 4}
    params = SamplingParams(temperature=0.0, max_tokens=64)
    llm = LLM(smollm2_gguf, speculative_config=options)
    prompt = llm.get_tokenizer().encode("The people who keep lighthouses are the people who keep lighthouses. " * 3)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    spec = llm.stats()["spec_decode"]
    llm.shutdown()
    replay = spec_decode.lookup_replay(prompt, list(out.outputs[0].token_ids),
                                       spec_decode.SpeculativeConfig.from_dict(options), params.max_tokens)
    assert replay["draft_tokens"] > 20 and len(out.outputs[0].token_ids) == 64
    assert (replay["draft_tokens"], replay["accepted_tokens"]) == (spec["num_draft_tokens"], spec["num_accepted_tokens"])


def test_each_round_echoes_another_modules_record_under_its_schema():
    """The JSON echo's rounds: another module's record each, whole in the prompt, and a schema that
    names every key of the record with its value's type and admits no other key."""
    sources = spec_decode.round_sources("json-echo", spec_decode.max_rounds())
    assert len(set(sources)) == len(sources) == len(spec_decode.JSON_MODULES) == spec_decode.max_rounds()
    cfg = spec_decode.SpecBenchConfig()
    for source in sources:
        record = spec_decode.json_record(spec_decode.REPOSITORY / source)
        assert record["module"] == source and record["lines"] == len((spec_decode.REPOSITORY / source).read_text()
                                                                      .splitlines())
        assert record["classes"] or record["functions"]
        assert json.dumps(record) in spec_decode.user_message("json-echo", source, cfg)
        schema = spec_decode.response_schema("json-echo", source)
        assert schema["required"] == list(record) and schema["additionalProperties"] is False
        assert {k: v["type"] for k, v in schema["properties"].items()} == {
            "module": "string", "lines": "integer", "imports": "array", "classes": "array", "functions": "array"}
    assert spec_decode.response_schema("chat", spec_decode.CHAT_PROMPTS[0]) is None
