"""Seeded workloads for the simulator: arrival times, sequence lengths, priorities, or a replayed trace.

`make_workload` is the entry point. The same seed gives the same requests; arrivals, lengths and
priorities come from separate random streams, so changing the rate, the arrival CV or the
high-priority share leaves the other two untouched (a priorities run and its baseline see the
very same requests).

Arrivals: Poisson (exponential gaps of mean 1/rate) or, with `cv`, Gamma gaps of the same mean
whose coefficient of variation is `cv` (shape 1/cv^2); `cv=0` (or below 1e-6) is evenly spaced.
The first request arrives at time 0.

Lengths (tokens), built from the statistics in `data/lengths.json` (their sources are there):

- Short / Medium / Long are the paper's power laws, built as the authors' generator builds them:
  rank K with P(K = k) proportional to k^-a over k = 1 .. 2m-1, length = min(ceil(c K), 6144) with
  c = m / E[K], for (m, a) = (128, 2.0), (256, 1.5), (512, 1.15). Their script scales by the mean of
  the batch it drew; here c uses the distribution's mean, so a request's length does not depend on
  how many were drawn with it. Against the paper's table (in parentheses; data/lengths.json says
  how sure those numbers are), for the exact distribution, not a sample:

      class  mean         P50        P80          P95            P99
      S      127 (128)    35 (38)    103 (113)    412 (413)      1682 (1464)
      M      254 (256)    30 (32)    163 (173)    1285 (1288)    4576 (4208)
      L      512 (512)    54 (55)    596 (582)    3127 (3113)    5262 (5166)

  Means within 1%, P50-P95 within 10%, P99 within 16% (tests hold samples to 3%, 12% and 20%).

- ShareGPT-like and BurstGPT-like lengths. No lognormal fits ShareGPT input: its P95/mean = 4.85
  exceeds the largest ratio a lognormal reaches, exp(1.645^2 / 2) = 3.87. So each of the four is
  a quantile table: log(length) is linear in the quantile between the paper's P50, P80, P95 and
  P99; above P99 it continues with the P95-P99 slope up to the 100th percentile; the shortest
  length (0th percentile) is solved within [1, P50] so that the mean matches. ShareGPT input
  needs a floor below 1 token, so it keeps the floor 1 and its mean comes out 1% high (309 for
  306); the other three match the mean exactly. P50-P99 match by construction.

Pairings S-S, M-M, L-L, S-L, L-S name the input class first, the output class second; input and
output are drawn independently.

`max_seq_len` caps input + output: a generated pair that exceeds it is redrawn (both lengths), as
the paper's traces keep only requests that fit, so the lengths that remain are the distribution
conditioned on fitting. A replayed trace is never altered: a row over the cap is an error.

High priority: exactly round(share x n) requests, chosen uniformly, are high priority.

multi-turn: chat conversations (`conversations`) whose every turn resends the conversation so
far, its earlier answers included, so a turn's prompt is its predecessor's prompt and output
plus a new message; the simulator sends a turn only after the previous answer and a think time.

system-prompt: a few long shared prompts (`system_prompts`: 8 of 512-2048 tokens, Zipf
popularity) each followed by a short question of the request's own and a short answer (S-S
lengths): the traffic of applications that prepend one fixed instruction block, where a prefix
cache saves most of the prefill. Every other workload's prompts share nothing.

Trace files (.csv with a header, or .jsonl with one object per line) have columns arrival_time
(seconds), input_len, output_len, and optionally priority ("high"/"normal") and a shared prefix
(prefix_id, prefix_len: rows with the same id start with the same prefix_len tokens, which
input_len includes; prefix_len must not exceed input_len). Rows are replayed in
arrival order with the first arrival moved to time 0; `rate` rescales time so the mean arrival
rate, (n - 1) / span, becomes `rate`. Extra columns are ignored. `write_trace` writes a
workload as such a CSV file, so that a generated workload can be replayed elsewhere (on a real
cluster, say) exactly.
"""

from __future__ import annotations

import csv
import functools
import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Iterator, Mapping, Protocol, Sequence

import numpy as np

from llumdask.prefix import mix, mix_int
from llumdask.request import Priority

PAIRINGS: dict[str, tuple[str, str]] = {
    "S-S": ("S", "S"),
    "M-M": ("M", "M"),
    "L-L": ("L", "L"),
    "S-L": ("S", "L"),
    "L-S": ("L", "S"),
}
REAL_TRACE_LIKE = ("sharegpt", "burstgpt")
SYSTEM_PROMPT = "system-prompt"
MULTI_TURN = "multi-turn"
# Prefix-sharing workloads (their prompts share segments; the others share nothing).
SHARING = (SYSTEM_PROMPT, MULTI_TURN)
WORKLOADS = (*PAIRINGS, *REAL_TRACE_LIKE, *SHARING)
TRACE_SUFFIXES = (".csv", ".jsonl", ".ndjson")
# Below this CV, Gamma gaps are even spacing for any practical purpose (and 1/cv^2 may overflow).
_EVEN_CV = 1e-6
# Redraw rounds allowed for pairs over max_seq_len before the cap is declared too small.
_MAX_REDRAW_ROUNDS = 200
# system-prompt: how many shared prompts, their length range (tokens), their popularity's skew.
_SYSTEM_PROMPTS = 8
_SYSTEM_PROMPT_LENGTHS = (512, 2048)
_SYSTEM_PROMPT_ZIPF = 1.0
# multi-turn: the chance a conversation goes on after each turn, its most turns, the mean think
# time between an answer and the next question, and the context a conversation stays within.
_NEXT_TURN = 1 / 3
_MAX_TURNS = 12
_THINK_SECONDS = 10.0
_CONVERSATION_CONTEXT = 8192


@dataclass(frozen=True)
class TraceRequest:
    """One request of a workload: when it arrives and how many tokens it reads and writes.

    `prefix` names the shared segments its prompt starts with, as (segment id, tokens): requests
    naming the same segments in the same order share that prefix token for token (a system
    prompt, say). The rest of the prompt, input_len minus the segments, is the request's own."""

    arrival: float
    input_len: int
    output_len: int
    priority: Priority = Priority.NORMAL
    prefix: tuple[tuple[int, int], ...] = ()
    # A conversation's next turn: the index of the request whose answer it follows (its prompt
    # is that request's prompt and output, then its own tokens), sent `think` seconds after that
    # answer ends; its `arrival` is only nominal. None: it arrives at `arrival`.
    after: int | None = None
    think: float = 0.0


# Prompt token ids lie in [1, _PROMPT_VOCAB]: within any model's vocabulary the simulator serves.
_PROMPT_VOCAB = 30_000
_K_SEGMENT, _K_OWN = 0x9E3779B97F4A7C15, 0xD1B54A32D192ED03


@functools.lru_cache(maxsize=256)
def _segment_tokens(segment: int, length: int) -> tuple[int, ...]:
    return tuple(_token_ids(mix_int(segment ^ _K_SEGMENT), length))


def _token_ids(key: int, length: int) -> list[int]:
    with np.errstate(over="ignore"):
        mixed = mix(np.uint64(key) + np.arange(length, dtype=np.uint64) * np.uint64(_K_OWN))
    return (mixed % np.uint64(_PROMPT_VOCAB) + np.uint64(1)).tolist()


def prompt_tokens(trace: TraceRequest, index: int, history: Sequence[int] = ()) -> list[int]:
    """The prompt of the workload's `index`-th request: the conversation so far (`history`, for a
    turn that follows another) or its shared segments, then tokens of its own (a function of the
    index, so no two requests share them by chance)."""
    tokens: list[int] = list(history)
    for segment, length in () if history else trace.prefix:
        tokens += _segment_tokens(segment, length)
    own = trace.input_len - len(tokens)
    return tokens + _token_ids(mix_int(index ^ _K_OWN), own) if own > 0 else tokens


class TraceFormatError(ValueError):
    """A trace file that cannot be replayed; the message names the file and line."""


class LengthDistribution(Protocol):
    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """`n` lengths (int64, each >= 1)."""
        ...


# ---------------------------------------------------------------------------------- lengths
@dataclass(frozen=True)
class ZipfLengths:
    """Power-law lengths: ceil(c K) capped at max_len, P(K = k) ~ k^-exponent on 1 .. 2 mean - 1."""

    mean: int
    exponent: float
    max_len: int
    _cdf: np.ndarray = field(init=False, repr=False, compare=False)
    _scale: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.mean < 1 or self.max_len < 1 or self.exponent <= 0:
            raise ValueError(f"Zipf lengths need mean >= 1, max_len >= 1, exponent > 0; got {self}")
        ranks = np.arange(1, 2 * self.mean, dtype=np.float64)
        weights = ranks ** -self.exponent
        pmf = weights / weights.sum()
        cdf = np.cumsum(pmf)
        cdf[-1] = 1.0  # so that every u in [0, 1) lands on a rank
        object.__setattr__(self, "_cdf", cdf)
        object.__setattr__(self, "_scale", self.mean / float(ranks @ pmf))

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        ranks = np.searchsorted(self._cdf, rng.random(n), side="right") + 1
        return np.minimum(np.ceil(self._scale * ranks), self.max_len).astype(np.int64)


@dataclass(frozen=True)
class QuantileLengths:
    """Lengths whose log is piecewise linear in the quantile through (probs[i], lengths[i])."""

    probs: tuple[float, ...]
    lengths: tuple[float, ...]

    def __post_init__(self) -> None:
        p, x = self.probs, self.lengths
        if len(p) != len(x) or len(p) < 2 or p[0] != 0.0 or p[-1] != 1.0:
            raise ValueError("a quantile table needs matching knots from probability 0 to 1")
        if any(b <= a for a, b in zip(p, p[1:])) or any(b < a for a, b in zip(x, x[1:])) or x[0] < 1:
            raise ValueError("quantile knots must rise: probabilities strictly, lengths from >= 1")

    @classmethod
    def from_percentiles(cls, mean: float, percentiles: Mapping[float, float]) -> "QuantileLengths":
        """Through the given percentiles; tail extended with the last slope; floor solved for the mean."""
        probs = sorted(percentiles)
        values = [float(percentiles[p]) for p in probs]
        if len(probs) < 2 or not all(0 < p < 1 for p in probs):
            raise ValueError("need at least two percentiles strictly between 0 and 1")
        slope = math.log(values[-1] / values[-2]) / (probs[-1] - probs[-2])
        top = values[-1] * math.exp(slope * (1.0 - probs[-1]))

        def table(floor: float) -> "QuantileLengths":
            return cls((0.0, *probs, 1.0), (floor, *values, top))

        low, high = 1.0, values[0]
        if table(low).mean() >= mean:
            return table(low)
        if table(high).mean() <= mean:
            return table(high)
        for _ in range(60):  # the mean rises with the floor: bisect
            mid = (low + high) / 2
            low, high = (mid, high) if table(mid).mean() < mean else (low, mid)
        return table((low + high) / 2)

    def mean(self) -> float:
        """Exact mean of the continuous table (rounding up to whole tokens adds about 0.5)."""
        total = 0.0
        for u0, u1, x0, x1 in zip(self.probs, self.probs[1:], self.lengths, self.lengths[1:]):
            total += (u1 - u0) * (x0 if x1 == x0 else (x1 - x0) / math.log(x1 / x0))
        return total

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        log_len = np.interp(rng.random(n), self.probs, np.log(self.lengths))
        return np.maximum(np.ceil(np.exp(log_len)), 1).astype(np.int64)


def _length_data() -> dict:
    text = resources.files("llumdask.sim").joinpath("data/lengths.json").read_text(encoding="utf-8")
    return json.loads(text)


def length_targets() -> dict[str, dict[str, float]]:
    """The paper's statistics each distribution reproduces: name -> {mean, p50, p80, p95, p99}."""
    return _length_data()["targets"]


def length_distribution(name: str) -> LengthDistribution:
    """"S", "M", "L", or "<sharegpt|burstgpt>-<input|output>"."""
    data = _length_data()
    targets = data["targets"]
    if name not in targets:
        raise ValueError(f"unknown length distribution {name!r}; expected one of {', '.join(targets)}")
    stats = targets[name]
    zipf = data["zipf"]
    if name in zipf["exponents"]:
        return ZipfLengths(int(stats["mean"]), float(zipf["exponents"][name]), int(zipf["max_len"]))
    percentiles = {int(key[1:]) / 100: value for key, value in stats.items() if key.startswith("p")}
    return QuantileLengths.from_percentiles(stats["mean"], percentiles)


def _lengths_for(name: str) -> tuple[LengthDistribution, LengthDistribution]:
    """(input, output) distributions of a named workload."""
    inputs, outputs = PAIRINGS.get(name, (f"{name}-input", f"{name}-output"))
    return length_distribution(inputs), length_distribution(outputs)


def _draw_pairs(
    name: str, rng: np.random.Generator, n: int, max_seq_len: int | None
) -> tuple[np.ndarray, np.ndarray]:
    inputs, outputs = _lengths_for(name)
    x, y = inputs.sample(rng, n), outputs.sample(rng, n)
    if max_seq_len is None:
        return x, y
    for _ in range(_MAX_REDRAW_ROUNDS):
        over = np.flatnonzero(x + y > max_seq_len)
        if over.size == 0:
            return x, y
        x[over], y[over] = inputs.sample(rng, over.size), outputs.sample(rng, over.size)
    raise ValueError(f"max_seq_len {max_seq_len} is too small for {name} lengths: too few pairs fit under it")


# --------------------------------------------------------------------------------- arrivals
def arrival_times(rng: np.random.Generator, n: int, rate: float, cv: float | None = None) -> np.ndarray:
    """`n` arrival times from 0: Poisson at `rate`, or Gamma gaps with coefficient of variation `cv`."""
    if n == 0:
        return np.zeros(0)
    mean_gap = 1.0 / rate
    if cv is None:
        gaps = rng.exponential(mean_gap, n - 1)
    elif cv < _EVEN_CV:
        gaps = np.full(n - 1, mean_gap)
    else:
        gaps = rng.gamma(1.0 / cv**2, cv**2 * mean_gap, n - 1)
    return np.concatenate(([0.0], np.cumsum(gaps)))


def arrivals_within(rng: np.random.Generator, rate: float, seconds: float) -> np.ndarray:
    """Poisson arrival times at `rate` in [0, `seconds`): as many as fall there, drawn in order
    (a longer window keeps a shorter one's times)."""
    times = np.cumsum(rng.exponential(1.0 / rate, int(rate * seconds * 2) + 16))
    while times[-1] < seconds:
        times = np.concatenate((times, times[-1] + np.cumsum(rng.exponential(1.0 / rate, len(times)))))
    return times[times < seconds]


def _high_priority_mask(rng: np.random.Generator, n: int, share: float) -> np.ndarray:
    mask = np.zeros(n, dtype=bool)
    mask[rng.choice(n, size=round(share * n), replace=False)] = True
    return mask


# ----------------------------------------------------------------------------- trace files
def _is_count(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _int_field(row: Mapping[str, object], key: str, where: str) -> int:
    value = row.get(key)
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            pass
    if not _is_count(value, 1):
        raise TraceFormatError(f"{where}: {key} must be an integer >= 1, got {row.get(key)!r}")
    return value


def _parse_row(row: Mapping[str, object], where: str) -> tuple[TraceRequest, bool]:
    """One trace row; also whether it states its priority."""
    raw_arrival = row.get("arrival_time")
    try:
        arrival = float(raw_arrival)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        arrival = math.nan
    if isinstance(raw_arrival, bool) or not (math.isfinite(arrival) and arrival >= 0):
        raise TraceFormatError(f"{where}: arrival_time must be a finite number >= 0, got {raw_arrival!r}")
    input_len = _int_field(row, "input_len", where)
    output_len = _int_field(row, "output_len", where)
    prefix: tuple[tuple[int, int], ...] = ()
    if row.get("prefix_id") not in (None, ""):
        prefix_id, prefix_len = _int_field(row, "prefix_id", where), _int_field(row, "prefix_len", where)
        if prefix_len > input_len:
            raise TraceFormatError(f"{where}: prefix_len {prefix_len} exceeds input_len {input_len}")
        prefix = ((prefix_id, prefix_len),)
    raw_priority = row.get("priority")
    stated = raw_priority not in (None, "")
    try:
        priority = Priority.parse(raw_priority) if stated else Priority.NORMAL  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise TraceFormatError(f"{where}: {exc}") from None
    return TraceRequest(arrival, input_len, output_len, priority, prefix), stated


def _csv_rows(path: Path) -> Iterator[tuple[Mapping[str, object], str]]:
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [c for c in ("arrival_time", "input_len", "output_len") if c not in (reader.fieldnames or ())]
        if missing:
            raise TraceFormatError(f"{path} line 1: the header lacks column(s) {', '.join(missing)}")
        for row in reader:
            yield row, f"{path} line {reader.line_num}"


def _jsonl_rows(path: Path) -> Iterator[tuple[Mapping[str, object], str]]:
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path} line {number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(f"{where}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise TraceFormatError(f"{where}: expected a JSON object, got {type(row).__name__}")
            yield row, where


def read_trace(path: str | Path, max_seq_len: int | None = None) -> tuple[list[TraceRequest], bool]:
    """The rows of a trace file in file order, and whether any row states its priority."""
    path = Path(path)
    if path.suffix.lower() not in TRACE_SUFFIXES:
        raise TraceFormatError(f"{path}: trace files must end in {', '.join(TRACE_SUFFIXES)}")
    if not path.is_file():
        raise FileNotFoundError(f"no such trace file: {path}")
    rows = _csv_rows(path) if path.suffix.lower() == ".csv" else _jsonl_rows(path)
    requests, any_stated = [], False
    for row, where in rows:
        request, stated = _parse_row(row, where)
        if max_seq_len is not None and request.input_len + request.output_len > max_seq_len:
            raise TraceFormatError(
                f"{where}: input_len + output_len = {request.input_len + request.output_len} exceeds max_seq_len {max_seq_len}"
            )
        requests.append(request)
        any_stated |= stated
    if not requests:
        raise TraceFormatError(f"{path}: the trace has no requests")
    return requests, any_stated


def write_trace(path: str | Path, requests: Sequence[TraceRequest]) -> Path:
    """Write `requests` as a CSV trace that `read_trace` (and so `make_workload`) replays exactly:
    arrival times keep every digit, and each row states its priority."""
    path = Path(path)
    if path.suffix.lower() != ".csv":
        raise ValueError(f"{path}: write_trace writes .csv trace files")
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(("arrival_time", "input_len", "output_len", "priority", "prefix_id", "prefix_len"))
        for r in requests:
            if len(r.prefix) > 1:
                raise ValueError("a trace file carries one shared prefix per request; this one has several segments")
            shared = r.prefix[0] if r.prefix else ("", "")
            writer.writerow((repr(r.arrival), r.input_len, r.output_len, r.priority.name.lower(), *shared))
    return path


def _replay(
    path: str, rate: float | None, num_requests: int | None, rng: np.random.Generator, share: float, max_seq_len: int | None
) -> list[TraceRequest]:
    rows, priorities_stated = read_trace(path, max_seq_len)
    if priorities_stated and share > 0:
        raise ValueError(f"{path} states priorities; high_priority_share applies only to traces without them")
    rows.sort(key=lambda r: r.arrival)
    if num_requests is not None:
        if num_requests > len(rows):
            raise ValueError(f"{path} has {len(rows)} requests; num_requests={num_requests} asks for more")
        rows = rows[:num_requests]
    start, span = rows[0].arrival, rows[-1].arrival - rows[0].arrival
    stretch = 1.0
    if rate is not None:
        if span == 0:
            raise ValueError(f"{path}: every request arrives at once, so there is no rate to rescale to {rate}")
        stretch = (len(rows) - 1) / span / rate
    high = _high_priority_mask(rng, len(rows), share) if share > 0 else np.zeros(len(rows), dtype=bool)
    return [
        TraceRequest(
            (r.arrival - start) * stretch,
            r.input_len,
            r.output_len,
            Priority.HIGH if h else r.priority,
            r.prefix,
        )
        for r, h in zip(rows, high)
    ]


# ------------------------------------------------------------------------------- workloads
def _check_args(
    rate: float | None, num_requests: int | None, cv: float | None, share: float, max_seq_len: int | None
) -> None:
    if rate is not None and not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a finite number > 0 (requests/s), got {rate!r}")
    if cv is not None and not (math.isfinite(cv) and cv >= 0):
        raise ValueError(f"cv must be a finite number >= 0, got {cv!r}")
    if not 0 <= share <= 1:
        raise ValueError(f"high_priority_share must be in [0, 1], got {share!r}")
    if num_requests is not None and not _is_count(num_requests, 0):
        raise ValueError(f"num_requests must be an integer >= 0, got {num_requests!r}")
    if max_seq_len is not None and not _is_count(max_seq_len, 2):
        raise ValueError(f"max_seq_len must be an integer >= 2 (one input and one output token), got {max_seq_len!r}")


def _workload_key(name: str) -> str:
    return name.upper() if name.upper() in PAIRINGS else name.lower()


def is_generated(name: str) -> bool:
    """A named workload drawn from length tables (it needs a rate and a count), not a trace file."""
    return _workload_key(name) in WORKLOADS


def make_workload(
    name: str,
    *,
    rate: float | None = None,
    num_requests: int | None = None,
    seed: int = 0,
    cv: float | None = None,
    high_priority_share: float = 0.0,
    max_seq_len: int | None = None,
) -> list[TraceRequest]:
    """A named workload (S-S, M-M, L-L, S-L, L-S, sharegpt, burstgpt, system-prompt) or a replayed trace file.

    Generated workloads need `rate` (requests/s) and `num_requests`. For a trace file, `rate` is
    optional (rescales time), `num_requests` takes the first that many, and `cv` does not apply.
    Returns requests in arrival order.
    """
    _check_args(rate, num_requests, cv, high_priority_share, max_seq_len)
    arrival_seed, length_seed, priority_seed = np.random.SeedSequence(seed).spawn(3)
    priority_rng = np.random.default_rng(priority_seed)
    key = _workload_key(name)
    if key not in WORKLOADS:
        if Path(name).suffix.lower() not in TRACE_SUFFIXES:
            raise ValueError(
                f"unknown workload {name!r}; expected one of {', '.join(WORKLOADS)} or a {'/'.join(TRACE_SUFFIXES)} trace file"
            )
        if cv is not None:
            raise ValueError("cv shapes generated arrivals; a trace file brings its own arrival times")
        return _replay(name, rate, num_requests, priority_rng, high_priority_share, max_seq_len)
    if rate is None or num_requests is None:
        raise ValueError(f"the generated workload {key} needs rate and num_requests")
    arrivals = arrival_times(np.random.default_rng(arrival_seed), num_requests, rate, cv)
    length_rng = np.random.default_rng(length_seed)
    high = _high_priority_mask(priority_rng, num_requests, high_priority_share)
    if key == MULTI_TURN:
        return conversations(np.random.default_rng(arrival_seed), length_rng, num_requests, rate, high,
                             max_seq_len or _CONVERSATION_CONTEXT)
    if key == SYSTEM_PROMPT:
        prefixes = system_prompts(length_rng, num_requests)
        longest = _SYSTEM_PROMPT_LENGTHS[1]
        if max_seq_len is not None and max_seq_len < longest + 2:
            raise ValueError(f"max_seq_len {max_seq_len} is too small for {key}: its shared prompts reach {longest} tokens")
        try:
            suffixes, outputs = _draw_pairs("S-S", length_rng, num_requests,
                                            None if max_seq_len is None else max_seq_len - longest)
        except ValueError as exc:
            raise ValueError(f"max_seq_len {max_seq_len} is too small for {key}: its shared prompts reach "
                             f"{longest} tokens, leaving {max_seq_len - longest} for the rest ({exc})") from None
        return [
            TraceRequest(float(a), prefix[1] + int(i), int(o), Priority.HIGH if h else Priority.NORMAL, (prefix,))
            for a, prefix, i, o, h in zip(arrivals, prefixes, suffixes, outputs, high)
        ]
    inputs, outputs = _draw_pairs(key, length_rng, num_requests, max_seq_len)
    return [
        TraceRequest(float(a), int(i), int(o), Priority.HIGH if h else Priority.NORMAL)
        for a, i, o, h in zip(arrivals, inputs, outputs, high)
    ]


def conversations(arrival_rng: np.random.Generator, length_rng: np.random.Generator, n: int, rate: float,
                  high: np.ndarray, context: int) -> list[TraceRequest]:
    """`n` requests as the turns of chat conversations (multi-turn). Conversations start as a
    Poisson process at rate / (mean turns), so that requests arrive at `rate` on average; each has
    min(Geometric(1/3), 12) turns (mean 2.98) and ends early where a turn would pass `context`
    tokens. A turn resends the whole conversation (earlier prompts and answers) plus a new user
    message, ShareGPT-like input and output lengths per turn, after a think time (exponential,
    mean `_THINK_SECONDS`) from the previous answer's end. Listed by nominal arrival (each turn
    `think` after its predecessor's arrival); the simulator sends a turn when its predecessor ends."""
    inputs, outputs = _lengths_for("sharegpt")
    mean_turns = sum((1 - _NEXT_TURN) ** k for k in range(_MAX_TURNS))
    turns: list[tuple[float, int, int, int, int, float]] = []  # (nominal arrival, conversation, turn, input, output, think)
    start, conversation = 0.0, 0
    while len(turns) < n:
        count = min(int(length_rng.geometric(_NEXT_TURN)), _MAX_TURNS)
        users, answers = inputs.sample(length_rng, count), outputs.sample(length_rng, count)
        thinks = arrival_rng.exponential(_THINK_SECONDS, count)
        history, nominal = 0, start
        for turn in range(count):
            prompt = history + int(users[turn])
            if prompt + int(answers[turn]) > context or len(turns) == n:
                break
            nominal += float(thinks[turn]) if turn else 0.0
            turns.append((nominal, conversation, turn, prompt, int(answers[turn]), float(thinks[turn]) if turn else 0.0))
            history = prompt + int(answers[turn])
        start += float(arrival_rng.exponential(mean_turns / rate))
        conversation += 1
    turns.sort()
    index = {(c, t): i for i, (_, c, t, *_rest) in enumerate(turns)}
    return [
        TraceRequest(a, i, o, Priority.HIGH if h else Priority.NORMAL, after=index[(c, t - 1)] if t else None, think=w)
        for (a, c, t, i, o, w), h in zip(turns, high)
    ]


def system_prompts(rng: np.random.Generator, n: int) -> list[tuple[int, int]]:
    """Each request's shared system prompt as (segment id, tokens): `_SYSTEM_PROMPTS` prompts of
    lengths drawn uniformly from `_SYSTEM_PROMPT_LENGTHS`, chosen by Zipf popularity (the k-th
    most popular with weight 1/k^_SYSTEM_PROMPT_ZIPF), as a few applications' prompts dominate
    a shared deployment."""
    low, high = _SYSTEM_PROMPT_LENGTHS
    lengths = rng.integers(low, high + 1, _SYSTEM_PROMPTS)
    weights = 1.0 / np.arange(1, _SYSTEM_PROMPTS + 1) ** _SYSTEM_PROMPT_ZIPF
    chosen = rng.choice(_SYSTEM_PROMPTS, size=n, p=weights / weights.sum())
    return [(int(k) + 1, int(lengths[k])) for k in chosen]
