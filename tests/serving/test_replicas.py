"""Engine replicas on a local Ray instance (serving/replicas.py): two replicas give one
engine's greedy outputs; requests that share a prefix land on one replica, where they hit its
prefix cache; killing a replica under load fails only its requests that had output, retries the
others elsewhere, and leaves no Ray process behind."""
from __future__ import annotations

import asyncio
import random

import psutil
import pytest
import ray  # a test dependency: missing, these tests must fail

from pagellm import LLM, SamplingParams
from pagellm.serving.replicas import NoReplicaError, ReplicaDiedError, ReplicaSet

OPTIONS = dict(block_size=4, num_kv_blocks=128, seed=0)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _prompts(n_systems: int, users: int) -> list[list[int]]:
    rng = random.Random(0)
    systems = [[rng.randrange(3, 320) for _ in range(24)] for _ in range(n_systems)]
    return [s + [rng.randrange(3, 320) for _ in range(4)] for _ in range(users) for s in systems]


async def _serve(replicas: ReplicaSet, prompts, params=GREEDY, prefix="r"):
    async def one(i, p):
        last = None
        async for out in replicas.generate(f"{prefix}{i}", {"prompt_token_ids": p}, params):
            last = out
        return last

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)), return_exceptions=True)


@pytest.fixture(scope="module")
def replicas(tiny_llama_dir):
    rs = ReplicaSet(dict(OPTIONS, model=tiny_llama_dir), 2, "cache_aware", threads_per_replica=1)
    pids = list(rs.pids)
    yield rs
    rs.close()
    # Ray started here, so it is stopped here, and the replicas' processes are gone.
    assert not ray.is_initialized()
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


def test_two_replicas_give_one_engine_s_outputs_and_keep_prefixes_together(replicas, tiny_llama_dir):
    prompts = _prompts(4, 3)  # 4 system prompts (6 blocks each) x 3 users
    want = LLM(tiny_llama_dir, **OPTIONS).generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                                   use_tqdm=False)
    # The first user of each system prompt, then the others (which find it cached where it went).
    got = asyncio.run(_serve(replicas, prompts[:4])) + asyncio.run(_serve(replicas, prompts[4:], prefix="s"))
    assert [list(o.outputs[0].token_ids) for o in got] == [list(o.outputs[0].token_ids) for o in want]
    stats = replicas.router.stats()
    assert sorted(stats.routed) == [6, 6]  # the 4 prefixes spread 2 and 2
    assert stats.prefix_routed == 8  # every later user of a prefix went where it was seen
    asyncio.run(replicas.poll_stats())
    hits = sum(r.stats.prefix_cache.hits for r in replicas.stats().replicas)
    assert hits >= 8 * 24 - 8 * 4  # each of those found its system prompt's full blocks cached


def test_dead_replicas_fail_only_what_they_had_started(replicas):
    """Runs last in this module: it kills both replicas. A replica killed while idle: the requests
    routed to it get nothing from it and are retried on the other; the other killed while it
    generates: its requests, which had output, fail; then no replica is left, a clear error."""
    replicas.router.policy = "round_robin"  # so that requests do go to the dead replica
    replicas.kill(0)
    retried = asyncio.run(_serve(replicas, _prompts(2, 2), prefix="t"))
    assert not any(isinstance(r, BaseException) for r in retried)
    assert replicas.router.alive == [1]
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def kill_while_generating():
        started = [asyncio.Event(), asyncio.Event()]

        async def one(i, p):
            async for _ in replicas.generate(f"u{i}", {"prompt_token_ids": p}, long):
                started[i].set()

        running = asyncio.gather(*(one(i, p) for i, p in enumerate(_prompts(2, 1))), return_exceptions=True)
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)  # both have output
        replicas.kill(1)
        return await running

    died = asyncio.run(kill_while_generating())
    assert len(died) == 2 and all(isinstance(e, ReplicaDiedError) for e in died), died
    with pytest.raises(NoReplicaError, match="no engine replica is serving"):
        asyncio.run(_serve_one(replicas))


async def _serve_one(replicas: ReplicaSet):
    async for _ in replicas.generate("v", {"prompt_token_ids": [5, 6, 7]}, GREEDY):
        pass
