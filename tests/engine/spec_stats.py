"""Speculative decoding's stats as the tests compare them."""
from __future__ import annotations


def without_times(stats: dict) -> dict:
    """stats()["spec_decode"] without the decode steps' times, which no two runs share: the
    proposals, what was kept, and how many decode steps of each number of rows ran."""
    return {**stats, "decode_steps_by_rows": {rows: e["steps"] for rows, e in stats["decode_steps_by_rows"].items()}}
