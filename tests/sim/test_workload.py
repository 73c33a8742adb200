import json
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llumdask.request import Priority
from llumdask.sim.workload import (
    PAIRINGS,
    WORKLOADS,
    QuantileLengths,
    TraceFormatError,
    TraceRequest,
    arrival_times,
    arrivals_within,
    length_distribution,
    length_targets,
    make_workload,
    prompt_tokens,
    write_trace,
)

PERCENTILES = {"p50": 50, "p80": 80, "p95": 95, "p99": 99}


def sample_stats(name, n=200_000, seed=7):
    lengths = length_distribution(name).sample(np.random.default_rng(seed), n)
    stats = {key: float(np.percentile(lengths, q)) for key, q in PERCENTILES.items()}
    stats["mean"] = float(lengths.mean())
    return lengths, stats


def within(value, target, tolerance):
    return abs(value - target) <= tolerance * target


# ------------------------------------------------------------------------- length statistics
@pytest.mark.parametrize("name", ["S", "M", "L"])
def test_power_law_classes_match_the_paper_table(name):
    # Tolerances stated in the module docstring: mean 3%, P50-P95 12%, P99 20%.
    target = length_targets()[name]
    lengths, stats = sample_stats(name)
    assert within(stats["mean"], target["mean"], 0.03)
    for key in ("p50", "p80", "p95"):
        assert within(stats[key], target[key], 0.12), (key, stats[key], target[key])
    assert within(stats["p99"], target["p99"], 0.20)
    assert lengths.min() >= 1 and lengths.max() <= 6144


@pytest.mark.parametrize("trace", ["sharegpt", "burstgpt"])
@pytest.mark.parametrize("side", ["input", "output"])
def test_real_trace_like_lengths_match_the_design_anchors(trace, side):
    name = f"{trace}-{side}"
    target = length_targets()[name]
    _, stats = sample_stats(name)
    # DESIGN.md section 4 anchors: mean (sharegpt-input documented 1% high) and P95.
    assert within(stats["mean"], target["mean"], 0.02), (stats["mean"], target["mean"])
    assert within(stats["p95"], target["p95"], 0.02)
    for key in ("p50", "p80", "p99"):
        assert within(stats[key], target[key], 0.03), (key, stats[key], target[key])


def test_design_anchor_values_are_the_ones_in_the_table():
    targets = length_targets()
    anchors = {
        "sharegpt-input": (306, 1484),
        "sharegpt-output": (500, 988),
        "burstgpt-input": (830, 2345),
        "burstgpt-output": (271, 669),
    }
    for name, (mean, p95) in anchors.items():
        assert (targets[name]["mean"], targets[name]["p95"]) == (mean, p95)


def test_quantile_tables_solve_the_floor_for_the_mean():
    targets = length_targets()
    for name in ("sharegpt-output", "burstgpt-input", "burstgpt-output"):
        table = length_distribution(name)
        assert table.mean() == pytest.approx(targets[name]["mean"], rel=1e-6)
        assert 1 < table.lengths[0] < targets[name]["p50"]
    # No floor >= 1 brings ShareGPT input down to 306: it keeps floor 1, 1% high (documented).
    table = length_distribution("sharegpt-input")
    assert table.lengths[0] == 1.0
    assert 306 < table.mean() < 306 * 1.02


def test_quantile_table_mean_is_exact_on_a_hand_case():
    # log-linear from 1 to e over [0, 1]: mean = (e - 1) / ln(e) = e - 1.
    table = QuantileLengths((0.0, 1.0), (1.0, float(np.e)))
    assert table.mean() == pytest.approx(np.e - 1)
    flat = QuantileLengths((0.0, 0.5, 1.0), (10.0, 10.0, 10.0))
    assert flat.mean() == pytest.approx(10.0)


def test_unknown_length_distribution_is_named():
    with pytest.raises(ValueError, match="'XL'"):
        length_distribution("XL")


# ------------------------------------------------------------------------------- pairings
@pytest.mark.parametrize("name", list(PAIRINGS))
def test_pairings_put_the_input_class_first(name):
    requests = make_workload(name, rate=10, num_requests=20_000, seed=3)
    targets = length_targets()
    input_class, output_class = name.split("-")
    assert within(np.mean([r.input_len for r in requests]), targets[input_class]["mean"], 0.10)
    assert within(np.mean([r.output_len for r in requests]), targets[output_class]["mean"], 0.10)


def test_names_are_case_insensitive():
    assert make_workload("s-l", rate=1, num_requests=50) == make_workload("S-L", rate=1, num_requests=50)
    assert make_workload("ShareGPT", rate=1, num_requests=50) == make_workload("sharegpt", rate=1, num_requests=50)


# ------------------------------------------------------------------------------- arrivals
def gaps(requests):
    return np.diff([r.arrival for r in requests])


def test_poisson_arrivals_have_the_rate_and_cv_one():
    requests = make_workload("S-S", rate=5, num_requests=50_000, seed=1)
    g = gaps(requests)
    assert requests[0].arrival == 0.0
    assert within(g.mean(), 0.2, 0.02)
    assert within(g.std() / g.mean(), 1.0, 0.03)


@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0])
def test_gamma_arrivals_keep_the_mean_rate_and_reach_the_cv(cv):
    g = gaps(make_workload("S-S", rate=4, num_requests=50_000, seed=2, cv=cv))
    assert within(g.mean(), 0.25, 0.05)
    assert within(g.std() / g.mean(), cv, 0.08)


def test_cv_zero_spaces_arrivals_evenly():
    assert np.allclose(gaps(make_workload("M-M", rate=2, num_requests=100, cv=0)), 0.5)


def test_arrival_times_of_nothing_is_empty():
    assert arrival_times(np.random.default_rng(0), 0, rate=1.0).size == 0
    assert make_workload("S-S", rate=1, num_requests=0) == []


# -------------------------------------------------------------------------- reproducibility
def test_same_seed_same_workload_other_seed_other_workload():
    a = make_workload("burstgpt", rate=3, num_requests=500, seed=11, cv=2, high_priority_share=0.1)
    b = make_workload("burstgpt", rate=3, num_requests=500, seed=11, cv=2, high_priority_share=0.1)
    c = make_workload("burstgpt", rate=3, num_requests=500, seed=12, cv=2, high_priority_share=0.1)
    assert a == b
    assert a != c


def test_streams_are_independent_so_baselines_see_the_same_requests():
    base = make_workload("S-S", rate=3, num_requests=400, seed=5)
    with_priority = make_workload("S-S", rate=3, num_requests=400, seed=5, high_priority_share=0.1)
    faster = make_workload("S-S", rate=6, num_requests=400, seed=5)
    assert [(r.arrival, r.input_len, r.output_len) for r in base] == [
        (r.arrival, r.input_len, r.output_len) for r in with_priority
    ]
    assert [(r.input_len, r.output_len) for r in base] == [(r.input_len, r.output_len) for r in faster]
    assert np.allclose([r.arrival for r in faster], [r.arrival / 2 for r in base])


# ------------------------------------------------------------------------------ priorities
@pytest.mark.parametrize("share, expected", [(0.0, 0), (0.1, 100), (0.25, 250), (1.0, 1000)])
def test_high_priority_share_is_exact(share, expected):
    requests = make_workload("S-S", rate=1, num_requests=1000, seed=4, high_priority_share=share)
    assert sum(r.priority is Priority.HIGH for r in requests) == expected


# --------------------------------------------------------------------------- sequence cap
def test_max_seq_len_redraws_pairs_instead_of_clipping():
    cap = 2000
    requests = make_workload("L-L", rate=1, num_requests=20_000, seed=6, max_seq_len=cap)
    totals = np.array([r.input_len + r.output_len for r in requests])
    assert totals.max() <= cap
    # Clipping the output would pile requests up at exactly the cap; redrawing does not.
    assert np.mean(totals == cap) < 0.002
    assert min(r.output_len for r in requests) >= 1


def test_paper_cap_leaves_the_power_law_untouched():
    # 6144 + 6144 < 13,616: no L-L pair is ever redrawn, so the cap changes nothing.
    assert make_workload("L-L", rate=1, num_requests=2000, seed=8, max_seq_len=13_616) == make_workload(
        "L-L", rate=1, num_requests=2000, seed=8
    )


def test_a_cap_no_pair_fits_under_is_an_error():
    with pytest.raises(ValueError, match="max_seq_len 10 is too small for L-L"):
        make_workload("L-L", rate=1, num_requests=10, max_seq_len=10)  # shortest L is 6 tokens


# ------------------------------------------------------------------------------------ speed
def test_ten_thousand_requests_well_under_a_second():
    start = time.perf_counter()
    for name in WORKLOADS:
        make_workload(name, rate=10, num_requests=10_000, cv=2, high_priority_share=0.1, max_seq_len=13_616)
    per_workload = (time.perf_counter() - start) / len(WORKLOADS)
    assert per_workload < 0.25


# ---------------------------------------------------------------------------- bad arguments
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"rate": 0, "num_requests": 1}, "rate must be"),
        ({"rate": float("inf"), "num_requests": 1}, "rate must be"),
        ({"rate": 1, "num_requests": -1}, "num_requests must be"),
        ({"rate": 1, "num_requests": 1.5}, "num_requests must be"),
        ({"rate": 1, "num_requests": 1, "cv": -1}, "cv must be"),
        ({"rate": 1, "num_requests": 1, "high_priority_share": 1.5}, "high_priority_share"),
        ({"rate": 1, "num_requests": 1, "max_seq_len": 1}, "max_seq_len must be"),
        ({"num_requests": 1}, "needs rate and num_requests"),
        ({"rate": 1}, "needs rate and num_requests"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_workload("S-S", **kwargs)


def test_unknown_workload_lists_the_choices():
    with pytest.raises(ValueError, match="unknown workload 'X-X'.*S-S.*sharegpt"):
        make_workload("X-X", rate=1, num_requests=1)


# ------------------------------------------------------------------------------ trace files
def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


CSV_TRACE = "arrival_time,input_len,output_len,priority,extra\n12.5,100,20,high,x\n10.0,50,10,,y\n11.0,70,30,normal,z\n"


def test_csv_replay_sorts_shifts_to_zero_and_reads_priorities(tmp_path):
    requests = make_workload(write(tmp_path, "t.csv", CSV_TRACE))
    assert requests == [
        TraceRequest(0.0, 50, 10, Priority.NORMAL),
        TraceRequest(1.0, 70, 30, Priority.NORMAL),
        TraceRequest(2.5, 100, 20, Priority.HIGH),
    ]


def test_jsonl_replay_matches_csv(tmp_path):
    rows = [
        {"arrival_time": 12.5, "input_len": 100, "output_len": 20, "priority": "high"},
        {"arrival_time": 10, "input_len": 50, "output_len": 10},
        {"arrival_time": 11.0, "input_len": 70, "output_len": 30, "priority": "normal"},
    ]
    text = "\n".join(json.dumps(r) for r in rows) + "\n\n"
    assert make_workload(write(tmp_path, "t.jsonl", text)) == make_workload(write(tmp_path, "t.csv", CSV_TRACE))


def test_replay_rate_rescales_time_and_num_requests_takes_the_first(tmp_path):
    path = write(tmp_path, "t.csv", CSV_TRACE)
    # Three requests over 2.5 s = 0.8 req/s; at 4 req/s the span is 0.5 s.
    assert [r.arrival for r in make_workload(path, rate=4)] == pytest.approx([0.0, 0.2, 0.5])
    assert [r.input_len for r in make_workload(path, num_requests=2)] == [50, 70]
    with pytest.raises(ValueError, match="has 3 requests"):
        make_workload(path, num_requests=4)


def test_replay_without_priorities_takes_the_share(tmp_path):
    text = "arrival_time,input_len,output_len\n" + "".join(f"{i},10,10\n" for i in range(20))
    path = write(tmp_path, "t.csv", text)
    requests = make_workload(path, high_priority_share=0.1, seed=1)
    assert sum(r.priority is Priority.HIGH for r in requests) == 2
    assert requests == make_workload(path, high_priority_share=0.1, seed=1)


def test_replay_refuses_a_share_over_stated_priorities_and_a_cv(tmp_path):
    path = write(tmp_path, "t.csv", CSV_TRACE)
    with pytest.raises(ValueError, match="states priorities"):
        make_workload(path, high_priority_share=0.1)
    with pytest.raises(ValueError, match="cv"):
        make_workload(path, cv=2)


def test_replay_rate_needs_a_time_span(tmp_path):
    path = write(tmp_path, "t.csv", "arrival_time,input_len,output_len\n1,10,10\n1,20,20\n")
    with pytest.raises(ValueError, match="every request arrives at once"):
        make_workload(path, rate=2)


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("t.csv", "arrival_time,input_len,output_len\n0,10,10\n1,abc,10\n", "t.csv line 3: input_len must be an integer >= 1, got 'abc'"),
        ("t.csv", "arrival_time,input_len,output_len\n0,10,0\n", "line 2: output_len must be an integer >= 1"),
        ("t.csv", "arrival_time,input_len,output_len\n-1,10,10\n", "line 2: arrival_time must be a finite number >= 0"),
        ("t.csv", "arrival_time,input_len,output_len\nsoon,10,10\n", "line 2: arrival_time"),
        ("t.csv", "arrival_time,input_len,output_len\n0,10\n", "line 2: output_len must be an integer >= 1, got None"),
        ("t.csv", "arrival_time,input_len,output_len\n0,10,10,urgent\n".replace("output_len\n", "output_len,priority\n"), "line 2: unknown priority 'urgent'"),
        ("t.csv", "arrival,input_len\n0,10\n", "line 1: the header lacks column\\(s\\) arrival_time, output_len"),
        ("t.csv", "", "line 1: the header lacks"),
        ("t.csv", "arrival_time,input_len,output_len\n", "the trace has no requests"),
        ("t.csv", "arrival_time,input_len,output_len\n0,10000,5000\n", "line 2: input_len \\+ output_len = 15000 exceeds max_seq_len 13616"),
        ("t.jsonl", '{"arrival_time": 0, "input_len": 1, "output_len": 1}\n{"arrival_time": 1,\n', "t.jsonl line 2: not valid JSON"),
        ("t.jsonl", "[1, 2, 3]\n", "line 1: expected a JSON object, got list"),
        ("t.jsonl", '{"arrival_time": 0, "input_len": 1.5, "output_len": 1}\n', "line 1: input_len must be an integer"),
        ("t.jsonl", '{"arrival_time": true, "input_len": 1, "output_len": 1}\n', "line 1: arrival_time"),
        ("t.jsonl", '\n\n{"arrival_time": 0, "input_len": 1, "output_len": 1, "priority": 7}\n', "line 3: unknown priority 7"),
    ],
)
def test_bad_trace_rows_name_the_file_and_line(tmp_path, name, text, message):
    path = write(tmp_path, name, text)
    with pytest.raises(TraceFormatError, match=message):
        make_workload(path, max_seq_len=13_616)


def test_missing_trace_file_and_unknown_suffix(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such trace file"):
        make_workload(str(tmp_path / "absent.csv"))
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload(write(tmp_path, "t.txt", "arrival_time,input_len,output_len\n0,1,1\n"))


# --------------------------------------------------------------------------------- property
@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(WORKLOADS),
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 300),
    cap=st.one_of(st.none(), st.integers(1500, 20_000)),
    cv=st.one_of(st.none(), st.floats(0, 5)),
    share=st.floats(0, 1),
)
def test_every_generated_workload_is_well_formed(name, seed, n, cap, cv, share):
    if name == "system-prompt" and cap is not None and cap < 2048 + 256:
        # Room for a shared prompt of up to 2,048 tokens and a short request after it, or a clear error.
        try:
            make_workload(name, rate=2.5, num_requests=n, seed=seed, max_seq_len=cap)
        except ValueError as exc:
            assert "too small for system-prompt" in str(exc)
        return
    requests = make_workload(name, rate=2.5, num_requests=n, seed=seed, cv=cv, high_priority_share=share, max_seq_len=cap)
    assert len(requests) == n
    arrivals = [r.arrival for r in requests]
    assert arrivals == sorted(arrivals)
    assert all(r.input_len >= 1 and r.output_len >= 1 for r in requests)
    if cap is not None:
        assert all(r.input_len + r.output_len <= cap for r in requests)
    assert sum(r.priority is Priority.HIGH for r in requests) == round(share * n)


def test_write_trace_replays_exactly(tmp_path):
    workload = make_workload("S-S", rate=3.3, num_requests=50, seed=7, high_priority_share=0.2)
    path = write_trace(tmp_path / "out" / "trace.csv", workload)
    assert make_workload(str(path)) == workload
    with pytest.raises(ValueError, match=r"\.csv"):
        write_trace(tmp_path / "trace.jsonl", workload)


# ------------------------------------------------------------------ shared prefixes
def test_system_prompt_requests_share_a_few_long_prompts_by_skewed_popularity():
    requests = make_workload("system-prompt", rate=10.0, num_requests=4000, seed=2)
    assert requests == make_workload("system-prompt", rate=10.0, num_requests=4000, seed=2)
    segments = {}
    for r in requests:
        ((segment, length),) = r.prefix
        assert segments.setdefault(segment, length) == length  # one length per prompt
        assert 512 <= length <= 2048 and r.input_len > length and r.output_len >= 1
    counts = sorted((sum(r.prefix[0][0] == s for r in requests) for s in segments), reverse=True)
    assert len(segments) == 8 and counts[0] > 3 * counts[-1]  # Zipf: the first about 8x the last
    (i, first), (j, second) = [(i, r) for i, r in enumerate(requests) if r.prefix == requests[0].prefix][:2]
    a, b = prompt_tokens(first, i), prompt_tokens(second, j)
    shared = sum(length for _, length in first.prefix)
    assert len(a) == first.input_len and a[:shared] == b[:shared] and a[shared] != b[shared]


def test_prompts_without_a_prefix_share_nothing():
    requests = make_workload("S-S", rate=10.0, num_requests=50, seed=0)
    firsts = {tuple(prompt_tokens(r, i)[:2]) for i, r in enumerate(requests)}
    assert len(firsts) == 50


def test_a_trace_carries_its_prefixes_through_a_file(tmp_path):
    requests = make_workload("system-prompt", rate=5.0, num_requests=30, seed=1)
    path = write_trace(tmp_path / "t.csv", requests)
    assert make_workload(str(path)) == requests
    bad = write(tmp_path, "bad.csv", "arrival_time,input_len,output_len,prefix_id,prefix_len\n0,10,5,3,11\n")
    with pytest.raises(TraceFormatError, match="prefix_len 11 exceeds input_len 10"):
        make_workload(bad)


def test_multi_turn_conversations_resend_their_history_and_arrive_at_the_rate():
    requests = make_workload("multi-turn", rate=4.0, num_requests=3000, seed=3)
    assert len(requests) == 3000 and requests == make_workload("multi-turn", rate=4.0, num_requests=3000, seed=3)
    firsts = [r for r in requests if r.after is None]
    assert 2.5 < len(requests) / len(firsts) < 3.2  # mean turns about 3
    for index, r in enumerate(requests):
        assert r.input_len + r.output_len <= 8192
        if r.after is not None:
            previous = requests[r.after]
            assert r.after < index and r.think > 0 and r.arrival == pytest.approx(previous.arrival + r.think)
            assert r.input_len > previous.input_len + previous.output_len  # history plus a new message
    span = max(r.arrival for r in firsts)
    assert len(requests) / span == pytest.approx(4.0, rel=0.25)
    # A turn's prompt starts with the conversation so far.
    follower = next(i for i, r in enumerate(requests) if r.after is not None)
    history = prompt_tokens(requests[requests[follower].after], requests[follower].after) + [1] * 5
    prompt = prompt_tokens(requests[follower], follower, history)
    assert prompt[: len(history)] == history and len(prompt) == requests[follower].input_len


def test_arrivals_within_a_window_are_poisson_and_a_longer_window_keeps_a_shorter_ones():
    short = arrivals_within(np.random.default_rng(5), 40.0, 10.0)
    long = arrivals_within(np.random.default_rng(5), 40.0, 100.0)
    assert np.all(np.diff(long) > 0) and long[0] >= 0 and long[-1] < 100.0
    assert np.array_equal(long[: len(short)], short) and long[len(short)] >= 10.0
    assert abs(len(long) - 4000) < 5 * np.sqrt(4000)  # five standard deviations of a Poisson count
