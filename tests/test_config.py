"""Engine options are declared once (pagellm.config.EngineConfig): LLM's keywords, every
command's flags and the checks all come from that one declaration."""
from __future__ import annotations

import dataclasses
import inspect

import pytest

from pagellm import LLM
from pagellm.config import EngineConfig, engine_kwargs, make_config
from pagellm.cli import build_parser


def test_every_option_is_a_keyword_of_llm_and_a_flag_of_every_command():
    names = [f.name for f in dataclasses.fields(EngineConfig)]
    params = inspect.signature(LLM).parameters
    assert [p for p in params if p in names] == names
    assert all(params[n].default == f.default for n, f in zip(names, dataclasses.fields(EngineConfig)))
    for command in ("generate", "chat", "serve"):
        args = build_parser().parse_args([command])
        assert engine_kwargs(args) == {f.name: f.default for f in dataclasses.fields(EngineConfig)}


def test_flags_parse_into_options():
    args = build_parser().parse_args(["serve", "--block-size", "32", "--kv-cache-memory", "512M", "-tp", "2",
                                      "--no-enable-prefix-caching", "--enforce-eager", "--dtype", "bfloat16"])
    config = EngineConfig(**engine_kwargs(args))
    assert (config.block_size, config.kv_cache_memory, config.tensor_parallel_size) == (32, 512 << 20, 2)
    assert config.enable_prefix_caching is False and config.enforce_eager is True and config.dtype == "bfloat16"
    assert EngineConfig(**engine_kwargs(build_parser().parse_args(["chat", "--kv-cache-memory", "0.25"]))) \
        .kv_cache_memory == 0.25


@pytest.mark.parametrize("options, words", [
    (dict(blocksize=4), ["unknown engine option 'blocksize'", "block_size"]),
    (dict(block_size=True), ["block_size", "True"]),
    (dict(block_size="16"), ["block_size", "'16'"]),
    (dict(enable_prefix_caching=1), ["enable_prefix_caching", "true or false", "1"]),
    (dict(dtype="int3"), ["dtype", "bfloat16", "int3"]),
    (dict(kv_policy="lru"), ["kv_policy", "contiguous-max"]),
    (dict(kv_cache_memory=1.5), ["kv_cache_memory", "(0, 1]", "1.5"]),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "lookup_max": 3}),
     ["speculative_config", "unknown key 'lookup_max'", "prompt_lookup_max"]),
    (dict(speculative_config={"method": "lookahead", "num_speculative_tokens": 4}),
     ["speculative_config", "method 'lookahead' is unknown", "'ngram'", "'draft_model'"]),
    (dict(speculative_config={"method": "suffix", "num_speculative_tokens": 4}),
     ["speculative_config", "method 'suffix' is not implemented yet"]),
    (dict(speculative_config={"method": "eagle3", "num_speculative_tokens": 1}),
     ["speculative_config", "method 'eagle3' is not implemented yet", "'mtp'"]),
    (dict(speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 1, "model": "d"}),
     ["speculative_config", "'model' belongs to method 'draft_model', not 'mtp'"]),
    (dict(speculative_config={"method": "draft_model", "num_speculative_tokens": 4}),
     ["speculative_config", "method 'draft_model' needs model", "None"]),
    (dict(speculative_config={"model": "d", "num_speculative_tokens": 4, "quantization": "fp8"}),
     ["speculative_config", "key 'quantization' is not implemented"]),
    (dict(speculative_config={"model": "d", "num_speculative_tokens": 4, "prompt_lookup_max": 3}),
     ["speculative_config", "'prompt_lookup_max' belongs to method 'ngram', not 'draft_model'"]),
    (dict(speculative_config={"method": "ngram", "model": "d", "num_speculative_tokens": 4}),
     ["speculative_config", "'model' belongs to method 'draft_model', not 'ngram'"]),
    (dict(speculative_config={"model": "d", "num_speculative_tokens": 4, "draft_tensor_parallel_size": 2}),
     ["draft_tensor_parallel_size", "[1, 1]", "one rank", "2"]),
    (dict(speculative_config={"method": "ngram"}), ["speculative_config", "num_speculative_tokens is required"]),
    (dict(speculative_config={"num_speculative_tokens": 0}), ["num_speculative_tokens", "[1, 64]", "0"]),
    (dict(speculative_config={"num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}),
     ["prompt_lookup_min (5)", "prompt_lookup_max (3)"]),
])
def test_bad_options_are_named(options, words):
    with pytest.raises((ValueError, TypeError)) as e:
        make_config(**options)
    for w in words:
        assert w in str(e.value)


def test_speculative_config_flag_is_vllm_json(capsys):
    flag = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}'
    config = EngineConfig(**engine_kwargs(build_parser().parse_args(["serve", "--speculative-config", flag])))
    spec = config.speculative
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min) == \
        ("ngram", 3, 5, 2)
    assert EngineConfig().speculative is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", '{"method": "eagle"}'])
    assert "--speculative-config" in capsys.readouterr().err


def test_a_bad_flag_value_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--dtype", "int3"])
    assert "--dtype" in capsys.readouterr().err


def test_every_flag_has_help():
    """`--help` explains every flag (and says the default where there is one)."""
    import argparse

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name in ("generate", "chat", "serve"):
        for action in commands[name]._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"pagellm {name} {action.option_strings[0]} has no help"
        commands[name].format_help()  # argparse expands every help text: a stray % fails here
