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
    assert "6 of 6 requests finished" in out


def test_demo_on_instances_too_small_says_what_it_refused(capsys):
    """Prompts of 200 tokens in 10 blocks never fit: refused, not reported as finished."""
    assert main(["--blocks", "10"]) == 0
    out = capsys.readouterr().out
    assert "0 of 6 requests finished" in out and "Refused, as they could never fit in 10 blocks: req-0" in out
