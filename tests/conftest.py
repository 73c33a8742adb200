"""Shared test setup.

Under CI (CI=true, as .ci/run sets it) hypothesis runs without per-example deadlines: a shared
machine's timing jitter would otherwise fail property tests that are correct.

Files run heaviest first: those with the most `slow` tests (engines, clusters, servers), then the
rest in their own order. The test workers take files in collection order (the Makefile
turns off pytest-xdist's reordering by test count, which put the long single-test files last, where
one of them ran alone while the other worker idled).
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
from hypothesis import settings

settings.register_profile("ci", deadline=None, print_blob=True)
if os.environ.get("CI", "").lower() == "true":
    settings.load_profile("ci")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])
