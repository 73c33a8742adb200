"""`llumdask demo` shows what its help promises: a live migration, and what it saved."""

from __future__ import annotations

import re

from llumdask.api.demo import main


def test_demo_migrates_a_request_and_saves_the_preemption(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    summary = re.search(r"(\d+) live migrations?, (\d+) preemptions?", out)
    pinned = re.search(r"Without migration: (\d+) preemptions?", out)
    assert summary and pinned, out
    migrations, preempted = int(summary[1]), int(summary[2])
    assert migrations >= 1 and re.search(r"migrated req-\d+ instance-\d+ -> instance-\d+", out)
    assert preempted < int(pinned[1])
    assert out.count(" finished: ") == 6
