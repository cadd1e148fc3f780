"""`pagellm bench soak`'s verdict on synthetic series (a flat run passes, each kind of leak fails),
its answer checks, and the /proc readings it takes of a server process. The soak against a real
server is tests/entrypoints/test_server_soak.py."""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys

import pytest

from pagellm.bench import procfs
from pagellm.bench.soak import MIN_TREND_SAMPLES, growth_checks, parse_duration, verdict
from pagellm.bench.soak_traffic import ANSWER, Invalid, check_choices, check_json
from pagellm.cli import main

MiB = 1 << 20


def series(n: int = 60, interval_s: float = 60.0, rss_per_sample: float = 0.0, fds_per_sample: float = 0.0,
           threads_per_sample: float = 0.0, seed: int = 0) -> list[dict]:
    """An hour of minute samples: noisy but flat, plus the given growth per sample."""
    rng = random.Random(seed)
    return [{"t_s": i * interval_s, "rss_bytes": 700 * MiB + rng.uniform(-3, 3) * MiB + i * rss_per_sample,
             "fds": 14 + rng.randint(0, 6) + int(i * fds_per_sample),
             "threads": 6 + rng.randint(0, 2) + int(i * threads_per_sample)} for i in range(n)]


def met(checks: list[dict]) -> dict[str, bool | None]:
    return {c["check"].split()[0]: c["met"] for c in checks}


def test_a_flat_run_passes_and_each_leak_fails():
    assert met(growth_checks(series())) == {"RSS": True, "fds": True, "threads": True}
    # 2% of the RSS per 10 minutes (the limit is 1%): 1.4 MiB a minute, under noise of +-3 MiB.
    assert met(growth_checks(series(rss_per_sample=1.4 * MiB))) == {"RSS": False, "fds": True, "threads": True}
    assert met(growth_checks(series(rss_per_sample=0.4 * MiB)))["RSS"] is True  # about 0.6%: within
    assert met(growth_checks(series(fds_per_sample=0.5))) == {"RSS": True, "fds": False, "threads": True}
    assert met(growth_checks(series(threads_per_sample=0.2))) == {"RSS": True, "fds": True, "threads": False}


def test_warm_up_lasts_until_every_kind_of_request_ran():
    """A first beam search or swap raises RSS once: that step is warm-up while some kind of request
    has not finished yet, and growth if every kind had."""
    step = series()
    for i, s in enumerate(step):
        s["rss_bytes"] += 40 * MiB * (i >= 30)
        s["all_kinds_done"] = i >= 30
    assert met(growth_checks(step))["RSS"] is True
    assert met(growth_checks([{**s, "all_kinds_done": True} for s in step]))["RSS"] is False
    never = [{**s, "all_kinds_done": False} for s in step]
    assert set(met(growth_checks(never)).values()) == {None}


def test_too_few_or_unmeasured_samples_leave_growth_open():
    short = series(n=MIN_TREND_SAMPLES, rss_per_sample=50 * MiB)
    assert set(met(growth_checks(short)).values()) == {None}
    unmeasured = [{"t_s": s["t_s"]} for s in series()]
    assert all(c["met"] is None and "not measured" in c["why"] for c in growth_checks(unmeasured))


def results(failed: int = 0, harm: int = 0, held: int | None = 0, samples: list[dict] | None = None) -> dict:
    return {"totals": {"failed": failed, "fuzz_harm": harm},
            "idle_end": {"held_blocks": held, "tables": {"7": [3]} if held else {}},
            "samples": series() if samples is None else samples}


@pytest.mark.parametrize("kwargs, failing", [
    ({}, None),
    ({"failed": 1}, "failed well-formed requests == 0"),
    ({"harm": 1}, "harmful fuzzed requests == 0"),
    ({"held": 2}, "held blocks once idle == 0"),
    ({"held": None}, "held blocks once idle == 0"),  # the server did not answer at the end
    ({"samples": series(rss_per_sample=2 * MiB)}, "RSS slope"),
])
def test_verdict_fails_on_each_cause(kwargs, failing):
    v = verdict(results(**kwargs))
    assert v["pass"] is (failing is None)
    assert [c["check"] for c in v["checks"] if c["met"] is False] == ([] if failing is None else
                                                                     [c["check"] for c in v["checks"]
                                                                      if c["check"].startswith(failing)])


def test_short_run_is_not_failed_for_its_length():
    v = verdict(results(samples=series(n=3)))
    assert v["pass"] and len(v["inconclusive"]) == 3


def test_answer_checks_refuse_what_was_not_asked_for():
    check_json('{"answer": "yes", "sure": false}', ANSWER)
    for text in ('{"answer": "maybe", "sure": false}', '{"answer": "yes"}', '{"answer": "yes", "sure": 1}',
                 '{"answer": "yes", "sure": true, "x": 1}', '{"answer": "yes", "sure"', None):
        with pytest.raises(Invalid):
            check_json(text, ANSWER)

    class Choice:
        def __init__(self, finish_reason: str) -> None:
            self.finish_reason = finish_reason

    check_choices([Choice("length")] * 2, 2, 32, 16)
    for choices, tokens in (([Choice("length")], 32), ([Choice("length")] * 2, 31), ([Choice("stop")] * 2, 32)):
        with pytest.raises(Invalid):
            check_choices(choices, 2, tokens, 16)


@pytest.mark.parametrize("text, seconds", [("90", 90), ("90s", 90), ("45m", 2700), ("1.5h", 5400)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["0", "-5m", "10d", "", "m"])
def test_bad_durations_are_named(text):
    with pytest.raises(ValueError, match=f"--duration .* got {text!r}"):
        parse_duration(text)


def test_soak_needs_one_target(capsys):
    assert main(["bench", "soak", "--duration", "1s"]) == 2
    assert "give exactly one of --url URL and --launch" in capsys.readouterr().err


def test_proc_readings_of_a_process_tree_and_a_listening_port():
    """A child with 3 extra threads and a grandchild: the tree's threads and RSS add up; the port this
    process listens on leads back to it."""
    code = ("import subprocess, sys, threading, time\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "[threading.Thread(target=time.sleep, args=(60,), daemon=True).start() for _ in range(3)]\n"
            "print(p.pid, flush=True); time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    grandchild = int(child.stdout.readline())
    try:
        sample = procfs.process_sample(child.pid)
        assert sample["threads"] == 4 and [c["pid"] for c in sample["children"]] == [grandchild]
        assert sample["total"]["threads"] == 5
        assert sample["total"]["rss_bytes"] > sample["rss_bytes"] > MiB and sample["fds"] >= 3
    finally:
        os.kill(grandchild, signal.SIGKILL)
        child.kill()
        child.wait()
    assert procfs.process_sample(child.pid) is None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert procfs.listening_pid(s.getsockname()[1]) == os.getpid()


@pytest.mark.slow  # starts a server: `make test-slow`
def test_launch_soaks_a_server_with_the_disk_tier(tmp_path):
    stem = tmp_path / "soak"
    rc = main(["bench", "soak", "--launch", "--duration", "8s", "--interval", "2", "--concurrency", "3",
               "--out", str(stem), "--no-progress"])
    data = json.loads(stem.with_suffix(".json").read_text())
    assert rc == 0, data["verdict"]
    assert "--kv-offload-dir" in data["server"]["engine_args"] and data["server"]["pid"]
    assert data["samples"] and all(s["kv_offload"] is not None for s in data["samples"])
    assert data["totals"]["failed"] == 0 and data["idle_end"]["held_blocks"] == 0
