"""Shared test setup.

Under CI (CI=true, as .ci/run sets it) hypothesis runs without per-example deadlines: a shared
machine's timing jitter would otherwise fail property tests that are correct.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", deadline=None, print_blob=True)
if os.environ.get("CI", "").lower() == "true":
    settings.load_profile("ci")
