"""Measurements that run in a process of their own."""

from __future__ import annotations

import os

import pytest
from dspark.bench.fresh_process import in_fresh_process


def test_the_function_runs_in_another_process_and_its_result_comes_back():
    assert in_fresh_process(os.getpid) != os.getpid()
    assert in_fresh_process(divmod, 17, 5) == (3, 2)


def test_the_functions_error_comes_back_with_its_message():
    with pytest.raises(ValueError, match="invalid literal"):
        in_fresh_process(int, "not a number")
