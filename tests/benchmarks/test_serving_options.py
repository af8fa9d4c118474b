"""The serving benchmark's CPU split and warm-up plan."""

from __future__ import annotations

import argparse
import os

import pytest

from benchmarks.serving import parse_cpus, split_cpus, warm_loads


def test_cpu_lists_read_as_taskset_writes_them():
    assert parse_cpus("12-15") == {12, 13, 14, 15}
    assert parse_cpus("0,2,4-5") == {0, 2, 4, 5}


def test_client_cpus_must_leave_the_server_some():
    mine = os.sched_getaffinity(0)
    with pytest.raises(SystemExit, match="--client-cpus"):
        split_cpus(",".join(map(str, sorted(mine))))
    with pytest.raises(SystemExit, match="--client-cpus"):
        split_cpus(str(max(mine) + 1000))
    assert split_cpus(None) == (None, None)
    assert os.sched_getaffinity(0) == mine


def test_every_level_is_warmed_largest_first():
    args = argparse.Namespace(concurrency=[1, 256, 64], num_requests=2048, min_requests=1024)
    assert warm_loads(args) == [(256, 2048), (64, 256), (1, 4)]
