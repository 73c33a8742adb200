"""The engine thread's work (`LlumletDriver`), with a fake llumlet and recording senders: held
tokens go when the step fails, when the engine has nothing left to do, and before queued calls
run; otherwise at most once per stream interval. A load report goes out every report interval,
also while the engine is idle, once reporting is on. Routes follow migrations to commit or expiry."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from inprocess import ManualClock

from llumdask.engine.base import StepResult, TokenOutput
from llumdask.prefix import PrefixEvents
from llumdask.plugins.llumlet_driver import REPORT_KEEPALIVE, LlumletDriver, Routes
from llumdask.request import FinishReason


class Senders:
    """What the driver sends: token hand-offs (first indexes, and the outputs), load reports."""

    def __init__(self) -> None:
        self.hand_offs: list[list[int]] = []
        self.outputs: list[TokenOutput] = []
        self.loads: list[dict] = []
        self.calls_waiting = False

    def push(self, due) -> None:
        self.hand_offs.append([output.first_index for _, output in due])
        self.outputs += [output for _, output in due]


def report(left: int) -> dict:
    """A load report as the fake sends it: its load, and its prefix-cache changes beside."""
    return {"steps_left": left, "prefix": {"stored": [left], "removed": [], "reset": False}}


class FakeLlumlet:
    """Each step emits the next token of request "r" (from index 1: not a first token)."""

    def __init__(self, driver: LlumletDriver, steps: int) -> None:
        self._driver = driver
        self.left = steps
        self.index = 1
        self.fail = False
        self.ticks = 0
        self.cache_changes = True  # each step stores a prefix block
        self.aborted: list[str] = []
        self.added: list[str] = []
        self.refused: set[str] = set()
        self.unseen = 0  # refused without being tried (after one refused in the same call)
        self.engine = SimpleNamespace(has_work=lambda: self.left > 0,
                                      get_request=lambda request_id: SimpleNamespace(num_output_tokens=self.index))

    def abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def received_unadded(self, count: int) -> None:
        self.unseen += count

    def add_request(self, request) -> None:
        if request.request_id in self.refused:
            raise ValueError(f"{request.request_id} can never fit")
        self.added.append(request.request_id)

    def tick(self) -> None:
        self.ticks += 1

    def load_report(self):
        return SimpleNamespace(to_dict=lambda: {"steps_left": self.left})

    def prefix_events(self):
        return PrefixEvents(stored=(self.left,)) if self.cache_changes else None

    def step(self) -> StepResult:
        self._driver.on_tokens(TokenOutput("r", self.index, (7,)))
        self.index += 1
        self.left -= 1
        if self.fail:
            raise RuntimeError("broken step")
        return StepResult(outputs=(), preempted=(), duration=0.001, num_prefill_tokens=0, batch_size=1)


@pytest.fixture
def senders():
    return Senders()


@pytest.fixture
def timer():
    return ManualClock()  # the report cadence's monotonic clock, set by hand


def make_driver(senders: Senders, timer: ManualClock, report_interval: float = 10.0, **options) -> LlumletDriver:
    """A driver sending through `senders` on the hand-set `timer`; tokens never due by time."""
    return LlumletDriver(stream_interval=3600.0, report_interval=report_interval, route_expiry=60.0,
                         push_tokens=senders.push, send_load=senders.loads.append, publish_event=lambda event: None,
                         calls_waiting=lambda: senders.calls_waiting, timer=timer, **options)


@pytest.fixture
def driver(senders, timer):
    driver = make_driver(senders, timer)
    driver.routes.owned["r"] = "tcp://gateway:1"
    return driver


def start(driver: LlumletDriver, steps: int) -> FakeLlumlet:
    """Attach a fake llumlet; its first step also makes the first report (due from the start)."""
    llumlet = FakeLlumlet(driver, steps)
    driver.attach(llumlet)
    return llumlet


def test_tokens_wait_for_the_interval_while_steps_make_progress_then_go_when_work_ends(driver, senders):
    start(driver, steps=4)
    assert driver.step_once() and senders.hand_offs == [[1]]  # the first hand-off is due at once
    assert driver.step_once() and driver.step_once()
    assert senders.hand_offs == [[1]]  # then the interval holds tokens back
    assert driver.step_once() is False  # the last step: nothing left, so everything goes
    assert senders.hand_offs == [[1], [2, 3, 4]]


def test_held_tokens_go_when_a_step_fails_and_the_request_ends_aborted(driver, senders):
    llumlet = start(driver, steps=5)
    driver.step_once()
    driver.step_once()
    llumlet.fail = True
    with pytest.raises(RuntimeError, match="broken step"):
        driver.step_once()
    # Tokens 2 and 3 (the failed step's), then the end after the 4 tokens "r" has.
    assert senders.hand_offs == [[1], [2, 3, 4]]
    end = senders.outputs[-1]
    assert end.token_ids == () and end.finished and end.finish_reason is FinishReason.ABORT
    assert llumlet.aborted == ["r"] and "r" not in driver.routes.owned


def test_an_engine_failing_steps_in_a_row_is_reported_broken_once_a_success_resets_the_count(senders, timer):
    broken: list[int] = []
    driver = make_driver(senders, timer, max_failed_steps=2, on_broken=broken.append)
    llumlet = start(driver, steps=10)
    outcomes = [True, False, True, False, False, False]  # step succeeds?
    for succeeds in outcomes:
        llumlet.fail = not succeeds
        if succeeds:
            driver.step_once()
        else:
            with pytest.raises(RuntimeError, match="broken step"):
                driver.step_once()
    # One failure, a success, then three in a row: broken at the second and the third.
    assert broken == [2, 3]


def test_held_tokens_go_before_queued_calls_run(driver, senders):
    start(driver, steps=5)
    driver.step_once()
    driver.step_once()
    senders.calls_waiting = True  # e.g. a KV stage to import
    driver.step_once()
    assert senders.hand_offs == [[1], [2, 3]]


def test_a_load_report_goes_out_every_report_interval_also_while_idle(driver, senders, timer):
    llumlet = start(driver, steps=3)
    driver.reporting = True
    driver.step_once()
    assert senders.hand_offs == [[1]] and senders.loads == [report(2)]
    timer.now = 5.0
    driver.step_once()  # tokens held, no report due: nothing sent
    assert senders.hand_offs == [[1]] and senders.loads == [report(2)]
    llumlet.left = 0  # idle from here on: the thread wakes every report interval
    timer.now = 10.0
    assert driver.step_once() is False
    assert senders.hand_offs == [[1], [2]] and senders.loads[-1] == report(0)
    assert llumlet.ticks == 2


def reporting_every_50_ms(senders: Senders, timer: ManualClock) -> tuple[LlumletDriver, FakeLlumlet]:
    """A driver reporting every 50 ms (the default) over an idle fake whose cache stands still."""
    driver = make_driver(senders, timer, report_interval=0.05)
    llumlet = start(driver, steps=0)
    llumlet.cache_changes = False
    driver.reporting = True
    return driver, llumlet


def test_a_report_that_says_nothing_new_waits_for_the_keepalive_but_any_change_goes_at_once(senders, timer):
    driver, llumlet = reporting_every_50_ms(senders, timer)
    driver.step_once()
    assert senders.loads == [{"steps_left": 0}]
    for now in (0.06, 0.12):  # idle, nothing new: the scheduler already knows
        timer.now = now
        driver.step_once()
    assert len(senders.loads) == 1 and llumlet.ticks == 3  # handshakes still expire every interval
    llumlet.left = 5  # a change goes at the next interval
    timer.now = 0.18
    driver.step_once()
    assert senders.loads[-1] == {"steps_left": 4} and len(senders.loads) == 2
    llumlet.left = 0
    llumlet.cache_changes = True  # prefix-cache changes always go: they are drained into each report
    timer.now = 0.24
    driver.step_once()
    assert len(senders.loads) == 3


def test_an_unchanged_report_still_goes_out_every_keepalive(senders, timer):
    driver, _ = reporting_every_50_ms(senders, timer)
    for k in range(35):  # two seconds, a report due at every wake-up
        timer.now = k * 0.06
        driver.step_once()
    assert len(senders.loads) == 3 == 1 + round(2.0 / REPORT_KEEPALIVE)


def test_handshakes_expire_before_registration_but_no_report_is_sent(driver, senders):
    llumlet = start(driver, steps=0)
    driver.step_once()
    assert llumlet.ticks == 1 and senders.loads == []


def test_routes_follow_incoming_migrations_to_commit_or_expiry():
    routes = Routes(expiry=10.0)
    routes.add_incoming("m1", "r1", "tcp://req:1", now=0.0)
    routes.add_incoming("m2", "r2", "tcp://req:2", now=0.0)
    routes.commit_incoming("m1")
    assert routes.owned == {"r1": "tcp://req:1"} and len(routes) == 2
    routes.sweep(now=5.0, is_known=lambda r: True)
    assert len(routes) == 2
    routes.sweep(now=11.0, is_known=lambda r: r != "r1")
    assert routes.owned == {} and len(routes) == 0


def test_a_destination_tells_the_requester_at_its_commit_that_it_owns_the_request(driver, senders):
    """An output without tokens at the request's length goes to the route the migration carried,
    so the requester's liveness check follows the new owner before its first token."""
    from llumdask.protocol import Committed

    start(driver, steps=0)  # its engine says the request has 1 output token
    driver.routes.add_incoming("m-in", "arriving", "tcp://gateway:2", now=0.0)
    driver.annotate(Committed("m-in", "arriving"))
    driver.annotate(Committed("m-unknown", "other"))  # expired meanwhile: nobody to tell
    assert senders.outputs == [TokenOutput("arriving", 1, ())]  # at once, before the commit is sent
    assert driver.routes.owned["arriving"] == "tcp://gateway:2"


def test_whereabouts_say_which_requests_are_here_moved_on_or_gone(driver):
    from llumdask.llumlet import MigrationEvent, MigrationEventKind

    llumlet = start(driver, steps=0)
    running = {"here"}
    llumlet.engine.get_request = lambda request_id: object() if request_id in running else None
    driver.routes.add_incoming("m-in", "arriving", "tcp://gateway:1", now=0.0)
    driver.on_event(MigrationEvent(MigrationEventKind.COMMITTED, "m-out", "left", "me", "tcp://other:1", 0.0))
    driver.on_event(MigrationEvent(MigrationEventKind.ABORTED, "m-x", "stayed", "me", "tcp://other:1", 0.0))
    found = driver.whereabouts(["here", "arriving", "left", "stayed", "never"])
    assert found.here == ("here", "arriving") and found.moved == {"left": "tcp://other:1"}
    assert found.gone == ("stayed", "never")  # an aborted migration moved nothing: gone unless running


def test_requests_handed_over_together_are_added_all_or_none(driver):
    """The choices of one completion come in one call (one engine-thread call, between the same two
    steps); if the engine refuses one, those added before it are aborted, none keeps a route."""
    from llumdask.request import Request

    llumlet = start(driver, steps=0)
    llumlet.refused = {"c"}
    with pytest.raises(ValueError, match="c can never fit"):
        driver.add([Request("a", [1, 2]), Request("b", [1, 2]), Request("c", [1, 2])], "tcp://gateway:2")
    assert llumlet.added == ["a", "b"] and llumlet.aborted == ["a", "b"] and llumlet.unseen == 0
    assert not {"a", "b", "c"} & set(driver.routes.owned)
    llumlet.refused = {"x"}
    with pytest.raises(ValueError, match="x can never fit"):  # y is never tried: received all the same
        driver.add([Request("x", [1, 2]), Request("y", [1, 2])], "tcp://gateway:2")
    assert llumlet.added == ["a", "b"] and llumlet.unseen == 1
    driver.add([Request("d", [1, 2]), Request("e", [1, 2])], "tcp://gateway:2")
    assert llumlet.added[2:] == ["d", "e"] and driver.routes.owned["e"] == "tcp://gateway:2"


def test_a_hand_over_aborted_before_its_add_arrived_is_refused_and_only_that_one(driver):
    """The add and its abort come on two connections; the abort names the hand-over it gives up on."""
    from llumdask.request import Request

    llumlet = start(driver, steps=0)
    driver.abort("a", hand_over="h1")
    driver.abort("b", hand_over="h1")  # the other choice placed with it
    with pytest.raises(ValueError, match="hand-over h1 was aborted before it arrived"):
        driver.add([Request("a", [1, 2]), Request("b", [1, 2])], "tcp://gateway:2", hand_over="h1")
    assert llumlet.added == [] and llumlet.unseen == 2  # received all the same: the scheduler's charge settles
    assert not {"a", "b"} & set(driver.routes.owned)
    driver.add([Request("a", [1, 2])], "tcp://gateway:2", hand_over="h2")  # placed again: runs
    driver.add([Request("c", [1, 2])], "tcp://gateway:2")
    assert llumlet.added == ["a", "c"]


def test_aborted_hand_overs_are_remembered_up_to_a_bound(driver, monkeypatch):
    from llumdask.plugins import llumlet_driver
    from llumdask.request import Request

    monkeypatch.setattr(llumlet_driver, "ABORTED_HAND_OVERS", 2)
    llumlet = start(driver, steps=0)
    for name in ("h1", "h2", "h1", "h3"):  # h1 named again: the latest two are h1 and h3
        driver.abort("r", hand_over=name)
    driver.add([Request("r", [1, 2])], "tcp://gateway:2", hand_over="h2")
    for name in ("h1", "h3"):
        with pytest.raises(ValueError):
            driver.add([Request("r", [1, 2])], "tcp://gateway:2", hand_over=name)
    assert llumlet.added == ["r"]


def test_a_resubmission_of_a_request_already_here_goes_on_here_with_its_route_renewed(driver):
    """Its source died once it had handed the request over: the requester resubmits it, and the
    scheduler may send it where it already runs."""
    from llumdask.request import Request

    llumlet = start(driver, steps=0)
    running = {"moved-here"}
    llumlet.engine.get_request = lambda request_id: object() if request_id in running else None
    driver.add([Request("moved-here", [1, 2])], "tcp://gateway:2", resubmission=True)
    assert llumlet.added == [] and driver.routes.owned["moved-here"] == "tcp://gateway:2"
    assert llumlet.unseen == 1  # received all the same: the scheduler's charge for it is settled
    driver.add([Request("new", [1, 2])], "tcp://gateway:2", resubmission=True)
    driver.add([Request("moved-here", [1, 2])], "tcp://gateway:3")  # not a resubmission: the engine decides
    assert llumlet.added == ["new", "moved-here"]
