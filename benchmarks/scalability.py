"""How long the real `GlobalScheduler` takes per decision as the cluster grows (paper section 6.6).

The paper's point is that a scheduler which tracks every request stalls as the cluster grows
(up to 40 ms per step at 64 instances), while Llumnix's global scheduler only sees one
constant-size load report per instance. This measures ours the way a host drives it: every
round each instance sends a fresh report, then a burst of requests is dispatched, then one
pairing round runs. Reports are synthetic but consistent (free + used = total, running blocks
split between priorities, `num_received` acknowledging what was dispatched), drawn so that some
instances are crowded and some free, so pairing has work to do.

With `prefix`, the instances' prefix caches are in play too: each report carries cache changes
(a few shared system-prompt chains and private blocks stored, as many evicted), each dispatch
the hashes of a prompt that starts with a shared chain, and the index's size is reported.

Only the scheduler calls are timed (perf_counter_ns around each one); building the synthetic
reports is not. Wall-clock timings vary with the machine and with other work on it: read them
as orders of magnitude against the goals, not as exact figures.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from typing import Callable, TypeVar

import numpy as np

from llumdask.benchmarks.common import parser, report
from llumdask.config import LlumdaskConfig, load_config
from llumdask.global_scheduler import DispatchInfo, GlobalScheduler
from llumdask.load import InstanceLoad
from llumdask.prefix import PrefixEvents, anchor_stride, anchors
from llumdask.request import Priority

# Goals from the design: dispatch must not add visible latency to a request, and a pairing
# round must fit well inside the 100 ms migration interval.
DISPATCH_P99_GOAL_US = 200.0
PAIRING_P99_GOAL_MS = 5.0
# LLaMA-7B on an A10: 13,616 tokens of KV cache in blocks of 16.
_TOTAL_BLOCKS = 851
_BLOCK_SIZE = 16
# Prefix traffic: shared chains of blocks (system prompts), how long, and the blocks an instance's
# cache stores and evicts per report.
_CHAINS, _CHAIN_BLOCKS, _CHURN = 64, 128, 16

T = TypeVar("T")


@dataclass(frozen=True)
class ScalabilityResult:
    """Per-call timings of one cluster size: dispatch and report in microseconds, pairing in ms."""

    instances: int
    dispatches: int
    rounds: int
    dispatch_p50_us: float
    dispatch_p99_us: float
    report_p50_us: float
    report_p99_us: float
    pairing_p50_ms: float
    pairing_p99_ms: float
    pairs_per_round: float
    # Entries (block hash, instance) in the scheduler's prefix index at the end (0 without prefix).
    index_entries: int = 0
    # What the index occupies then, in bytes (`PrefixIndex.memory_bytes`).
    index_bytes: int = 0

    @property
    def meets_goals(self) -> bool:
        return self.dispatch_p99_us < DISPATCH_P99_GOAL_US and self.pairing_p99_ms < PAIRING_P99_GOAL_MS

    def to_dict(self) -> dict[str, float | int | bool]:
        return asdict(self) | {"meets_goals": self.meets_goals}


def _synthetic_load(rng: np.random.Generator, instance_id: str, received: int) -> InstanceLoad:
    """A plausible report: anything from idle to overloaded, a tenth of the batch high priority."""
    used = int(rng.integers(0, _TOTAL_BLOCKS + 1))
    running = int(rng.integers(0, 48)) if used else 0
    high = min(running, int(rng.binomial(running, 0.1)))
    high_blocks = used * high // running if running else 0
    waiting = int(rng.integers(0, 6)) if used > _TOTAL_BLOCKS // 2 else 0
    head = int(rng.integers(1, 64)) if waiting else 0
    return InstanceLoad(
        instance_id,
        _TOTAL_BLOCKS,
        _BLOCK_SIZE,
        free_blocks=_TOTAL_BLOCKS - used,
        num_running=running,
        num_waiting=waiting,
        running_blocks={Priority.NORMAL: used - high_blocks, Priority.HIGH: high_blocks},
        running_count={Priority.NORMAL: running - high, Priority.HIGH: high},
        head_of_line_demand=head,
        waiting_demand=head * waiting,
        pending_prefill_tokens=head * waiting * _BLOCK_SIZE,
        num_received=received,
    )


def _timed(call: Callable[[], T], into: list[int]) -> T:
    """Run `call`, append its duration in ns to `into`, return its result."""
    started = time.perf_counter_ns()
    result = call()
    into.append(time.perf_counter_ns() - started)
    return result


def measure(
    instances: int,
    *,
    rounds: int = 100,
    dispatches_per_round: int = 20,
    policy: str = "llumnix",
    seed: int = 0,
    base: LlumdaskConfig | None = None,
    prefix: bool = False,
) -> ScalabilityResult:
    """Time reports, dispatches and pairing rounds of one `GlobalScheduler` over `instances`."""
    for name, value in (("instances", instances), ("rounds", rounds), ("dispatches_per_round", dispatches_per_round)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"scalability {name} must be an integer >= 1, got {value!r}")
    config = base or load_config()
    config = replace(config, dispatch=replace(config.dispatch, policy=policy), migration=replace(config.migration, enabled=True))
    scheduler = GlobalScheduler(config)
    ids = [f"instance-{i}" for i in range(instances)]
    for instance_id in ids:
        scheduler.register_instance(instance_id, _TOTAL_BLOCKS, _BLOCK_SIZE, 0.0)
        scheduler.mark_ready(instance_id, 0.0)
    rng = np.random.default_rng(seed)
    caches = _PrefixTraffic(rng, ids, scheduler) if prefix else None
    handed = dict.fromkeys(ids, 0)
    report_ns: list[int] = []
    dispatch_ns: list[int] = []
    pairing_ns: list[int] = []
    pairs = 0
    for round_index in range(rounds):
        now = float(round_index)
        # Each instance acknowledges everything dispatched to it so far, as a live one would.
        for load in [_synthetic_load(rng, i, handed[i]) for i in ids]:
            events = caches.events(load.instance_id) if caches else None
            _timed(lambda load=load, now=now, events=events: scheduler.report(load, now, events), report_ns)
        for _, target in scheduler.release(now):  # requests held for room, as a host places them
            handed[target] += 1
        prompts = rng.integers(16, 512, size=dispatches_per_round)
        for k, prompt in enumerate(prompts):
            hashes = caches.prompt(int(prompt)) if caches else ()
            info = DispatchInfo(f"r{round_index}-{k}", int(prompt) + len(hashes) * _BLOCK_SIZE, 256, block_hashes=hashes)
            target = _timed(lambda info=info, now=now: scheduler.dispatch(info, now), dispatch_ns)
            if target is not None:  # else held: placed by a later round's release
                handed[target] += 1
        pairs += len(_timed(lambda now=now: scheduler.pair_migrations(now), pairing_ns))
    return ScalabilityResult(
        instances=instances,
        dispatches=len(dispatch_ns),
        rounds=rounds,
        dispatch_p50_us=_percentile(dispatch_ns, 50) / 1e3,
        dispatch_p99_us=_percentile(dispatch_ns, 99) / 1e3,
        report_p50_us=_percentile(report_ns, 50) / 1e3,
        report_p99_us=_percentile(report_ns, 99) / 1e3,
        pairing_p50_ms=_percentile(pairing_ns, 50) / 1e6,
        pairing_p99_ms=_percentile(pairing_ns, 99) / 1e6,
        pairs_per_round=pairs / rounds,
        index_entries=len(scheduler.prefix),
        index_bytes=scheduler.prefix.memory_bytes(),
    )


class _PrefixTraffic:
    """Synthetic prefix caches: every instance holds parts of a few shared chains and private
    blocks, up to its pool; each report stores _CHURN blocks and evicts as many. Caches and
    prompts are told by their anchor blocks, as engines report them and requesters send them."""

    def __init__(self, rng: np.random.Generator, ids: list[str], scheduler: GlobalScheduler) -> None:
        self._rng = rng
        # Private blocks first (half the pool), numbered apart per instance.
        self._held = {i: list(anchors(range((k + 1) << 32, ((k + 1) << 32) + _TOTAL_BLOCKS // 2), _BLOCK_SIZE)) for k, i in enumerate(ids)}
        self._fresh = 1 << 48
        weights = 1.0 / np.arange(1, _CHAINS + 1)
        self._popularity = weights / weights.sum()
        for instance_id in ids:
            for chain in rng.choice(_CHAINS, size=3, replace=False, p=self._popularity):
                self._held[instance_id] += anchors(self._chain(int(chain))[: int(rng.integers(16, _CHAIN_BLOCKS))], _BLOCK_SIZE)
            scheduler.report(_synthetic_load(rng, instance_id, 0), 0.0, PrefixEvents(stored=tuple(self._held[instance_id])))

    @staticmethod
    def _chain(chain: int) -> list[int]:
        return [(chain + 1) << 40 | block for block in range(_CHAIN_BLOCKS)]

    def events(self, instance_id: str) -> PrefixEvents:
        held = self._held[instance_id]
        churn = _CHURN // anchor_stride(_BLOCK_SIZE)
        evicted = [held.pop(int(self._rng.integers(len(held)))) for _ in range(churn)]
        stored = list(range(self._fresh, self._fresh + churn))
        self._fresh += churn
        held += stored
        return PrefixEvents(tuple(stored), tuple(evicted))

    def prompt(self, own_blocks: int) -> tuple[int, ...]:
        """A shared chain's prefix (Zipf-popular) followed by the request's own blocks."""
        chain = int(self._rng.choice(_CHAINS, p=self._popularity))
        shared = self._chain(chain)[: int(self._rng.integers(16, _CHAIN_BLOCKS))]
        own = range(self._fresh, self._fresh + own_blocks // _BLOCK_SIZE)
        self._fresh += own_blocks // _BLOCK_SIZE
        return anchors(shared + list(own), _BLOCK_SIZE)


def main(argv: list[str] | None = None) -> int:
    p = parser("Scheduler time per call as the cluster grows, without and with prefix-aware dispatch")
    p.add_argument("--instances", default="16,64,256,1024", help="cluster sizes (default %(default)s)")
    p.add_argument("--rounds", type=int, default=100, help="report rounds per size (default %(default)s)")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.instances.split(",")]
    rounds = 5 if args.quick else args.rounds
    rows = []
    for size in sizes:  # both variants of a size back to back: the machine's state is shared
        for prefix in (False, True):
            rows.append(measure(size, rounds=rounds, prefix=prefix).to_dict() | {"prefix": prefix})
    columns = [("instances", "instances", "{}"), ("prefix", "prefix", "{}"),
               ("dispatch_p50_us", "dispatch p50 us", "{:.0f}"), ("dispatch_p99_us", "dispatch p99 us", "{:.0f}"),
               ("report_p50_us", "report p50 us", "{:.1f}"), ("report_p99_us", "report p99 us", "{:.1f}"),
               ("pairing_p99_ms", "pairing p99 ms", "{:.2f}"), ("index_entries", "index entries", "{}"),
               ("index_bytes", "index bytes", "{:,}")]
    largest = [r for r in rows if r["instances"] == max(sizes)]
    notes = [f"{max(sizes)} instances: dispatch P99 {largest[1]['dispatch_p99_us']:.0f} us with the prefix index, "
             f"{largest[0]['dispatch_p99_us']:.0f} us without (goal {DISPATCH_P99_GOAL_US:.0f} us); "
             f"{largest[1]['index_entries']:,} index entries in {largest[1]['index_bytes'] / 1e6:.1f} MB"]
    report("scalability_prefix" + ("_quick" if args.quick else ""), args.out, rows, columns,
           {"rounds": rounds, "dispatches_per_round": 20, "chains": _CHAINS}, notes)
    return 0



def _percentile(values: list[int], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


if __name__ == "__main__":
    raise SystemExit(main())
