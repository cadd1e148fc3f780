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
])
def test_bad_options_are_named(options, words):
    with pytest.raises((ValueError, TypeError)) as e:
        make_config(**options)
    for w in words:
        assert w in str(e.value)


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
