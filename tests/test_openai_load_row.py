"""The closed-loop load's summary counts the requests decoding over the measured window only."""

from __future__ import annotations

import pytest

from llumdask.benchmarks.openai_load import Run, Sample, row


def test_decoding_is_the_mean_count_of_requests_between_first_and_last_token_inside_the_window():
    window = (10.0, 20.0)
    samples = [
        Sample(start=9.0, first=9.5, last=19.5, end=19.6, tokens=11, every_first=9.5),  # decodes 10.0-19.5 inside: 9.5 s
        Sample(start=12.0, first=13.0, last=15.0, end=15.1, tokens=11, every_first=13.0),  # 2 s
        Sample(start=18.0, first=19.0, last=25.0, end=25.1, tokens=11, every_first=19.0),  # 1 s inside
        Sample(start=1.0, first=2.0, last=5.0, end=5.1, tokens=11, every_first=2.0),  # before the window: 0
    ]
    result = row(2, [Run(samples, [], window), Run([], [], (30.0, 40.0))])
    assert result["decoding_mean"] == pytest.approx((9.5 + 2 + 1) / 20)
    assert result["successful"] == 2  # started inside a window
