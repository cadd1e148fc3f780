"""The KV block map, loaded in a real headless browser (Debian's chromium) while requests run."""
from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import os

import fastapi  # noqa: F401  (the server extra is a test dependency: missing, this module must fail)
import httpx
import pytest

from server_utils import MODEL_NAME

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
# 52 tokens: three full blocks of 16 that the n sequences of one request share.
SHARED_PROMPT = ("The old lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a lantern, "
                 "a notebook and a thermos of tea, and wrote down the name of every ship that passed the rocks "
                 "below, the colour of its sails and the song its sailors sang.")


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        # CI installs it (.ci/run): there a missing browser is a failure, not a reason to skip.
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed, and CI must run the dashboard tests")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return path


def browse(url: str, *extra: str, budget_ms: int = 2500) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="pagellm-chromium-") as profile:
        cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1400,900",
               f"--virtual-time-budget={budget_ms}", *extra, url]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=90)


def dump_dom(url: str) -> str:
    proc = browse(url, "--dump-dom")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def cell_states(dom: str) -> list[str]:
    """The state of each drawn cell of the block map, in block order."""
    return re.findall(r'<div class="cell (\w+)"[^>]*data-cell=', dom)


def grid_attrs(dom: str) -> dict[str, int]:
    m = re.search(r'<div id="grid"([^>]*)>', dom)
    assert m, dom[:2000]
    return {k: int(v) for k, v in re.findall(r'data-(\w+)="(\d+)"', m.group(1))}


class Background:
    """Streaming requests on a thread of their own, held open until `close()`."""

    def __init__(self, url: str, bodies: list[dict]) -> None:
        self.url, self.bodies = url, bodies
        self.started = threading.Event()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.started.wait(120), "no request produced a token"

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # surfaced by close()
            self.error = e
            self.started.set()

    async def _main(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=120) as http:
            await asyncio.gather(*(self._one(http, b) for b in self.bodies))

    async def _one(self, http: httpx.AsyncClient, body: dict) -> None:
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    self.started.set()
                if self.stop.is_set():
                    return  # hang up: the server aborts the request

    def close(self) -> None:
        self.stop.set()
        self.thread.join(60)
        if self.error is not None:
            raise self.error


@pytest.fixture(scope="module")
def server(smollm2_server):
    smollm2_server.wait_all_blocks_free()
    return smollm2_server


def test_dashboard_draws_every_block_when_idle(server):
    dom = dump_dom(server.url + "/dashboard")
    n = server.state()["num_blocks"]
    attrs = grid_attrs(dom)
    assert attrs["cells"] == n
    states = cell_states(dom)
    assert len(states) == n and set(states) <= {"free", "cached"}
    assert attrs["used"] == attrs["shared"] == 0
    assert MODEL_NAME in dom
    # The table of groups of layers: one group of full attention, holding nothing.
    assert 'id="kvGroups" data-rows="1"' in dom
    assert '<tr data-group="0" data-kind="full" data-blocks="0">' in dom


def test_dashboard_shows_shared_blocks_of_parallel_sampling_then_preemption(server):
    # The forks run long (they outlast the browser's visits below; the client hangs up at the end).
    forks = Background(server.url, [{"model": MODEL_NAME, "prompt": SHARED_PROMPT, "n": 4, "max_tokens": 1000,
                                      "temperature": 1.0, "seed": 1, "ignore_eos": True}])
    # 12 more requests of 56-token prompts (no shared prefix: each starts with its own number): 16
    # sequences outgrow the pool of 91 blocks after ~35 tokens each, and the latest are preempted.
    # They start once the forks run, so the forks are the oldest and keep their shared blocks: the
    # scheduler preempts the latest admitted.
    load = None
    try:
        load = Background(server.url, [{"model": MODEL_NAME, "prompt": f"Story {i}. {SHARED_PROMPT}",
                                        "max_tokens": 300, "temperature": 1.0, "seed": i, "ignore_eos": True}
                                       for i in range(12)])
        # The siblings fork once the prompt is computed; wait for them.
        deadline = time.monotonic() + 60
        while True:
            state = server.state()
            shared = [b for b, r in enumerate(state["ref_cnt"]) if r > 1]
            if len(shared) >= 3 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert len(shared) >= 3, state
        groups = state["groups"]
        # The shared blocks belong to the sequences of one request: its n forks.
        owners = {rid for rid, table in state["tables"].items() if shared[0] in table}
        assert len(owners) >= 2 and len({groups.get(rid, rid) for rid in owners}) == 1

        dom = dump_dom(server.url + "/dashboard")
        attrs = grid_attrs(dom)
        assert attrs["cells"] == state["num_blocks"]
        assert attrs["shared"] >= 3 and attrs["used"] >= attrs["shared"]
        states = cell_states(dom)
        assert len(states) == state["num_blocks"]
        assert states.count("shared") == attrs["shared"] and "used" in states

        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "dashboard.png"
        shot.unlink(missing_ok=True)
        proc = browse(server.url + "/dashboard", f"--screenshot={shot}")
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert shot.stat().st_size > 20_000

        # Each sequence's block table, by request: its cells, with the forks' shared prompt blocks.
        dom = dump_dom(server.url + "/dashboard?view=tables")
        rows = re.findall(r'<div class="trow" data-id="([^"]+)"', dom)
        assert len(rows) >= 5 and set(rows) <= set(server.state()["tables"]) | set(state["tables"])
        tables = dom[dom.index('id="tables"'):]
        assert len(re.findall(r'class="cell shared" data-block', tables)) >= 3 * 2

        # Then the pool runs out: the page names who was preempted and lists the queue in order.
        deadline = time.monotonic() + 90
        while not state["recent_preemptions"] and time.monotonic() < deadline:
            time.sleep(0.3)
            state = server.state()
        assert state["recent_preemptions"], "no preemption under this load"
        assert any(s["preemptions"] for s in state["sequences"])
        dom = dump_dom(server.url + "/dashboard")
        shown = re.findall(r'<div class="row" data-id="([^"]+)"', dom[dom.index('id="preemptions"'):dom.index('id="queue"')])
        assert shown and set(shown) <= {p["id"] for p in server.state()["recent_preemptions"]}
        assert re.search(r'id="preemptions" data-count="([1-9]\d*)"', dom)
        # Running and waiting count sequences; the request count counts user requests (n = 4 is one).
        assert 'running sequences' in dom and 'finished since start' in dom and 'finished / min' in dom
        shot = ARTIFACTS / "dashboard-preemption.png"
        shot.unlink(missing_ok=True)
        proc = browse(server.url + "/dashboard", f"--screenshot={shot}")
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert shot.stat().st_size > 20_000
    finally:
        if load is not None:
            load.close()
        forks.close()
    server.wait_all_blocks_free()


def test_dashboard_state_describes_every_sequence(server):
    """Each unfinished sequence: its state, tokens so far and the start of its prompt; the queue in
    order; preempted sequences say so."""
    load = Background(server.url, [{"model": MODEL_NAME, "prompt": "Describe the sea at night.", "max_tokens": 200,
                                    "temperature": 1.0, "seed": 3, "ignore_eos": True}])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            seqs = server.state()["sequences"]
            if seqs and seqs[0]["output_tokens"] > 0:
                break
            time.sleep(0.1)
        (seq,) = seqs
        assert seq["state"] == "running" and seq["prompt_head"].endswith("Describe the sea at night.")
        assert seq["prompt_tokens"] > 5 and seq["output_tokens"] > 0 and seq["preemptions"] == 0
        assert seq["computed_tokens"] >= seq["prompt_tokens"]
    finally:
        load.close()
    server.wait_all_blocks_free()
