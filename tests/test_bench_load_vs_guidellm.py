"""benchmarks/load_vs_guidellm.py, its comparison logic (running GuideLLM is a benchmark,
never in the tests): the request counts both clients send, GuideLLM's per-request rows read
from its JSON, and the one definition applied to both sides."""
from __future__ import annotations

import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import load_vs_guidellm as b  # noqa: E402


def test_a_concurrency_point_sends_a_multiple_of_its_streams():
    assert b.point_requests("concurrent", 4.0, 6) == 4   # was 4 for qeval against 6 for GuideLLM
    assert b.point_requests("concurrent", 4.0, 8) == 8
    assert b.point_requests("concurrent", 4.0, 2) == 4   # at least one per stream
    assert b.point_requests("poisson", 0.5, 7) == 7


def _req(start, first, last, n, target=None):
    t = {"request_start": start, "first_token_iteration": first, "last_token_iteration": last}
    if target is not None:
        t["targeted_start"] = target
    return {"info": {"timings": t}, "output_tokens": n}


def test_guidellm_rows_are_relative_to_its_first_send_and_in_send_order():
    bench = {"requests": {"successful": [_req(1005.0, 1007.0, 1008.0, 11, 1004.9), _req(1000.0, 1001.0, 1002.0, 11)]}}
    rows = b._guidellm_sends(bench)
    assert [(r["send"], r["first"], r["last"], r["tokens"]) for r in rows] == [(0.0, 1.0, 2.0, 11), (5.0, 7.0, 8.0, 11)]
    assert rows[1]["target"] == pytest.approx(4.9)
    assert b._guidellm_sends({"requests": {"successful": [{"info": {"timings": {}}}]}}) is None


def test_one_definition_over_per_request_rows():
    rows = [{"send": 0.0, "first": 1.0, "last": 2.0, "tokens": 11},   # TTFT 1, ITL 0.1
            {"send": 0.0, "first": 3.0, "last": 3.5, "tokens": 11},   # TTFT 3, ITL 0.05
            {"send": 4.0, "first": 6.0, "last": 7.0, "tokens": 6}]    # TTFT 2, ITL 0.2
    f = b.common_figures(rows)
    assert f["ttft_p50_s"] == pytest.approx(2.0)
    assert f["itl_p50_s"] == pytest.approx(0.1)
    assert f["output_tokens_per_s"] == pytest.approx(28 / 7.0)
