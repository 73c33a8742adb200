"""The notebook client with text: generate, stop strings, chat, streams and batches of prompts,
on a real two-process LocalCluster whose sim instances draw tokens from the tiny model's vocabulary."""

from __future__ import annotations

import asyncio

import pytest
from daskhelpers import assert_workers_clean, reference_tokens

from llumdask.api.client import RequestRejected, TextIterator, connect
from llumdask.api.gateway.tokenizer import load_tokenizer, model_location
from llumdask.config import load_config
from llumdask.request import FinishReason

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(model_location(None))


@pytest.fixture(scope="module")
def overrides(tokenizer) -> dict:
    return {"sim-engine": {"total-blocks": 128, "vocab-size": tokenizer.vocab_size}}


@pytest.fixture(scope="module")
def llum(overrides):
    from llumdask.clusters.local import local_cluster

    cluster = local_cluster(2, config_overrides=overrides)
    client = connect(cluster)
    try:
        yield client
    finally:
        client.close()
        cluster.close()


@pytest.fixture
def clean(llum):
    yield llum
    assert_workers_clean(llum.dask_client)


def expected(overrides: dict, tokenizer, prompt: str, max_tokens: int) -> list[int]:
    """The sim engine's tokens for the prompt alone, ending at the model's EOS as text prompts do."""
    return reference_tokens(load_config(overrides), tokenizer.encode(prompt), max_tokens,
                            stop_token_ids=(tokenizer.eos_token_id,))


def test_text_in_text_out_with_usage(clean, overrides, tokenizer):
    result = clean.generate("Hello world", max_tokens=20, timeout=30)
    tokens = expected(overrides, tokenizer, "Hello world", 20)
    assert result.token_ids == tokens and result.text == tokenizer.decode(tokens)
    assert result.usage == {"prompt_tokens": len(tokenizer.encode("Hello world")), "completion_tokens": len(tokens),
                            "total_tokens": len(tokenizer.encode("Hello world")) + len(tokens),
                            # Shorter than a KV block: nothing of it can be in the prefix cache.
                            "prompt_tokens_details": {"cached_tokens": 0}}
    assert result.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)


def test_a_stop_string_ends_the_text_before_it_and_frees_the_request(clean, overrides, tokenizer):
    full = tokenizer.decode(expected(overrides, tokenizer, "Once upon a time", 60))
    stop = next(full[i:i + 3] for i in range(len(full) // 2, len(full) - 3) if full[i:i + 3].strip())
    result = clean.generate("Once upon a time", max_tokens=60, stop=[stop], timeout=30)
    assert result.text == full[: full.index(stop)] and result.finish_reason is FinishReason.STOP
    # The answer's tokens end with the one that completed the stop string, as the gateway's and vLLM's.
    tokens = expected(overrides, tokenizer, "Once upon a time", 60)
    assert result.token_ids == tokens[:_stop_at(tokenizer, tokens, stop)]
    # `clean` checks that the aborted request left no block behind.


def _stop_at(tokenizer, tokens: list[int], stop: str, min_tokens: int = 0) -> int | None:
    """How many tokens an answer keeps, the last completing `stop` past the text of its first
    `min_tokens` (vLLM's rule, token by token, a trailing partial character not yet text); None if
    it never does."""
    def text(count: int) -> str:
        return tokenizer.decode(tokens[:count]).rstrip("\ufffd")

    least = len(text(min_tokens))
    for count in range(min_tokens + 1, len(tokens) + 1):
        at = text(count).find(stop, max(0, least - len(stop) + 1))
        if at >= 0:
            return count
    return None


def test_stop_strings_count_past_min_tokens_and_stop_tokens_leave_no_text(clean, overrides, tokenizer):
    prompt = "A long story"
    sampling = {"min_tokens": 12, "ignore_eos": True}
    tokens = reference_tokens(load_config(overrides), tokenizer.encode(prompt), 40, **sampling)
    full = tokenizer.decode(tokens)
    early = tokenizer.decode(tokens[:6])
    # A stop string found in the first tokens' text, again later: the earlier one does not count.
    stop = next(early[i:i + 2] for i in range(len(early) - 2) if full.count(early[i:i + 2]) >= 2
                and _stop_at(tokenizer, tokens, early[i:i + 2], 12) is not None)
    kept = _stop_at(tokenizer, tokens, stop, 12)
    result = clean.generate(prompt, max_tokens=40, stop=[stop], timeout=30, **sampling)
    assert kept > 12 and result.token_ids == tokens[:kept] and result.finish_reason is FinishReason.STOP
    assert result.text == full[: full.index(stop, len(tokenizer.decode(tokens[:12]).rstrip("\ufffd")) - len(stop) + 1)]
    # A requested stop token ends the answer with its id kept and its text left out.
    token = next(t for t in tokens[15:] if tokenizer.decode([t]).strip())
    ended = reference_tokens(load_config(overrides), tokenizer.encode(prompt), 40, stop_token_ids=(token,),
                             ignore_eos=True)
    result = clean.generate(prompt, max_tokens=40, stop_token_ids=[token], ignore_eos=True, timeout=30)
    assert result.token_ids == ended and ended[-1] == token
    assert result.text == tokenizer.decode(ended[:-1]) and result.finish_reason is FinishReason.STOP


def test_the_text_stream_adds_up_to_the_generation(clean, tokenizer):
    whole = clean.generate("The weather", max_tokens=30, timeout=30)
    stream = clean.stream("The weather", max_tokens=30)
    assert isinstance(stream, TextIterator)
    deltas = list(stream)
    assert "".join(deltas) == whole.text and all(deltas)
    assert stream.token_ids == whole.token_ids and stream.finish_reason is whole.finish_reason

    async def collect() -> str:
        return "".join([d async for d in clean.stream("The weather", max_tokens=30)])

    assert asyncio.run(collect()) == whole.text


def test_chat_renders_the_models_template(clean, tokenizer):
    messages = [{"role": "user", "content": "Hi there"}]
    rendered = tokenizer.render_chat(messages)
    result = clean.chat(messages, max_tokens=12, timeout=30)
    assert result.usage["prompt_tokens"] == len(tokenizer.encode(rendered, add_special_tokens=False))
    assert result.text == tokenizer.decode(result.token_ids)
    [again] = clean.chat([messages], max_tokens=12, progress=False, timeout=30)
    assert again.text == result.text


def test_a_batch_keeps_input_order_and_reports_a_failure_in_its_place(clean, overrides, tokenizer):
    prompts = [f"Prompt number {k}" for k in range(6)]
    results = clean.generate(prompts, max_tokens=10, concurrency=2, timeout=60)
    assert [r.text for r in results] == [tokenizer.decode(expected(overrides, tokenizer, p, 10)) for p in prompts]
    # One that can never fit fails alone; token-id prompts mix with text.
    mixed = clean.generate(["short", [5] * 128 * 16, [5, 6, 7]], max_tokens=40, progress=False, timeout=60)
    assert mixed[0].text is not None and mixed[2].text is None and len(mixed[2].token_ids) >= 1
    assert isinstance(mixed[1], RequestRejected)


def test_bad_input_is_refused_before_anything_is_sent(clean):
    with pytest.raises(ValueError, match="stop strings need a text prompt"):
        clean.generate([1, 2, 3], stop=["x"])
    with pytest.raises(ValueError, match="concurrency"):
        clean.generate(["a", "b"], concurrency=0)
    with pytest.raises(ValueError, match="concurrency"):
        clean.generate("a", concurrency=0)
    with pytest.raises(ValueError, match="goes to chat"):
        clean.generate([{"role": "user", "content": "Hi"}])
    with pytest.raises(ValueError, match="prompt must"):
        clean.generate([])
    with pytest.raises(ValueError, match="temperature"):
        clean.generate("Hello", temperature=-1)
    for timeout in ("5", -1, float("nan")):
        with pytest.raises(ValueError, match="timeout must be None or a number of seconds > 0"):
            clean.generate(["a", "b"], timeout=timeout)
        with pytest.raises(ValueError, match="timeout"):
            clean.generate("a", timeout=timeout)
    with pytest.raises(ValueError, match="seed must be a 64-bit integer"):
        clean.generate([1, 2], temperature=1, seed=2**70)
    with pytest.raises(ValueError, match="token ids"):
        clean.generate([2**70])
    with pytest.raises(ValueError, match="stop_token_ids must be a list of token ids"):
        clean.generate("Hello", stop_token_ids=5)  # checked before the model's end token joins them
    for stop in (5, [None], [b"x"]):
        with pytest.raises(ValueError, match="stop must be a string or a list of strings"):
            clean.generate("Hello", stop=stop)
    for served in ({"model": 5}, {"chat_template": " "}, {"trust_remote_code": "yes"}):
        with pytest.raises(ValueError, match=next(iter(served))):
            connect(clean.dask_client, **served)
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        clean.generate("Hello", stop=[""])
    with pytest.raises(ValueError, match="messages"):
        clean.chat([])


def test_a_prompt_that_is_none_fails_in_its_place_and_the_others_run(clean, overrides, tokenizer):
    """Each element of a batch is a prompt: one that fails its checks (an empty text, a single id,
    a message without a role, a lone surrogate, bytes) is its ValueError in its place."""
    import numpy as np

    bad = ["", 5, [{"content": "hi"}], "a\ud800", b"hi", None, [5, True]]
    results = clean.generate_batch(["fine", *bad, np.array([5, 6, 7])], max_tokens=4, progress=False, timeout=60,
                                   stop=None, stop_token_ids=[np.int64(9)])
    assert results[0].text == tokenizer.decode(expected(overrides, tokenizer, "fine", 4))
    assert all(isinstance(r, ValueError) for r in results[1:-1]) and len(results[-1].token_ids) >= 1
    chats = clean.chat([[{"role": "user", "content": "hi"}], [{"role": "bogus", "content": "x"}], [None]],
                       max_tokens=4, progress=False, timeout=60)
    assert chats[0].text is not None and all(isinstance(r, ValueError) for r in chats[1:])
    assert "role" in str(chats[1])


def test_tokens_from_another_vocabulary_are_a_clear_error(clean):
    """Instances that serve a bigger vocabulary than the tokenizer's: the text client says so
    instead of decoding nonsense, and aborts the request (`clean` checks its blocks)."""
    other = connect(clean.dask_client)
    other.tokenizer = _Narrow(clean.tokenizer)
    try:
        with pytest.raises(ValueError, match="outside the tokenizer's vocabulary of 8"):
            other.generate("Hello world", max_tokens=40, ignore_eos=True, timeout=30)
    finally:
        other.close()


class _Narrow:
    """The tiny tokenizer claiming a vocabulary of 8 tokens (the instances draw from 512)."""

    vocab_size = 8

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_a_dask_bag_of_prompts_becomes_a_bag_of_generations_in_order(clean, overrides, tokenizer):
    import dask.bag as db

    prompts = [f"Row {k} of the table" for k in range(10)] + [[5] * 128 * 16]  # the last never fits
    bag = clean.map(db.from_sequence(prompts, npartitions=3), max_tokens=8, concurrency=4)
    results = clean.dask_client.compute(bag).result(timeout=120)
    assert [r.text for r in results[:-1]] == [tokenizer.decode(expected(overrides, tokenizer, p, 8))
                                              for p in prompts[:-1]]
    assert isinstance(results[-1], RequestRejected)
    # Each worker process submits its partitions through one requester, kept for later ones.
    listeners = clean.dask_client.run(_partition_listeners)
    assert sorted(len(held) for held in listeners.values()) in ([0, 1], [1, 1]), listeners
    salted = clean.map(db.from_sequence(prompts[:4], npartitions=4), max_tokens=8, cache_salt="tenant-a")
    assert [r.text for r in clean.dask_client.compute(salted).result(timeout=120)] == [r.text for r in results[:4]]
    again = clean.dask_client.run(_partition_listeners)
    assert all(again[w][:len(held)] == held for w, held in listeners.items()), (listeners, again)
    with pytest.raises(ValueError, match="temperature"):
        clean.map(db.from_sequence(["a"]), temperature=-1)
    with pytest.raises(ValueError, match="cache_salt"):
        clean.map(db.from_sequence(["a"]), cache_salt="a/b")
    # Every element is a prompt of its own, however the partitions fall: a single id is none.
    ids = clean.dask_client.compute(clean.map(db.from_sequence([5, [5, 6], 7, ""], npartitions=2),
                                              max_tokens=2)).result(timeout=120)
    assert len(ids) == 4 and isinstance(ids[0], ValueError) and len(ids[1].token_ids) >= 1
    assert isinstance(ids[2], ValueError) and isinstance(ids[3], ValueError)


def _partition_listeners() -> list[str | None]:
    """The token addresses of the clients this worker's batch partitions submit through."""
    from llumdask.api import batch

    return [llm.requester.token_address for llm in batch._clients.values()]


def test_a_dataframe_column_of_prompts_becomes_a_frame_of_completions(clean, overrides, tokenizer, tmp_path):
    import dask.dataframe as dd
    import pandas as pd

    prompts = pd.Series([f"Question {k}" for k in range(7)], index=[f"q{k}" for k in range(7)], name="prompt")
    frame = clean.map(dd.from_pandas(prompts, npartitions=3), max_tokens=8, concurrency=3)
    frame.to_parquet(tmp_path / "scored")  # computed on the cluster as ordinary tasks
    scored = pd.read_parquet(tmp_path / "scored")
    assert list(scored.index) == list(prompts.index)
    assert list(scored["text"]) == [tokenizer.decode(expected(overrides, tokenizer, p, 8)) for p in prompts]
    assert scored["error"].isna().all() and (scored["completion_tokens"] >= 1).all()
    assert list(scored["prompt_tokens"]) == [len(tokenizer.encode(p)) for p in prompts]
    with pytest.raises(TypeError, match="dask.bag.Bag or a dask.dataframe Series"):
        clean.map(["not", "a", "collection"])
    # A row that is no prompt is its error row; the partition's other rows are scored.
    rows = pd.Series(["hello", None, "world", ""], index=list("abcd"), name="prompt")
    mixed = clean.map(dd.from_pandas(rows, npartitions=1), max_tokens=4).compute()
    assert mixed["error"].isna().tolist() == [True, False, True, False]
    assert mixed.loc["b", "error"].startswith("ValueError: prompt must")


def test_an_asynchronous_dask_client_gets_awaitables(clean):
    from distributed import Client

    async def main():
        async with Client(clean.dask_client.scheduler.address, asynchronous=True) as dask_client:
            async with connect(dask_client) as llm:
                result = await llm.generate("Hello world", max_tokens=8)
                deltas = [d async for d in llm.stream("Hello world", max_tokens=8)]
                batch = await llm.generate(["One", "Two"], max_tokens=4, progress=False)
                table = await llm.instances()
        return result, deltas, batch, table

    result, deltas, batch, table = asyncio.run(main())
    assert "".join(deltas) == result.text and len(result.token_ids) >= 1
    assert [type(r).__name__ for r in batch] == ["Generation", "Generation"]
    assert len(table) == 2


def test_a_batch_that_completes_a_stop_string_keeps_its_tokens_up_to_it(tokenizer):
    """The text iterator on its own, fed one batch of several tokens: the tokens after the one that
    completed the stop string are not the answer's (nor their log probabilities)."""
    from llumdask.api.gateway.detok import IncrementalText

    ids = tokenizer.encode("Hello there, general Kenobi", add_special_tokens=False)
    stop = "there"
    kept = next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k]))
    assert kept < len(ids)

    class Tokens:
        request_id, instance, finish_reason, logprobs, prompt_logprobs = "r", None, None, None, None
        _batches = [list(ids), []]
        aborted: list[str] = []

        class _client:
            class requester:
                @staticmethod
                async def abort(request_id):
                    Tokens.aborted.append(request_id)

        async def _next_tokens(self):
            return self._batches.pop(0)

    deltas = TextIterator(Tokens(), IncrementalText(tokenizer, [stop]), tokenizer.vocab_size)

    async def read() -> list[str]:
        out = []
        while (delta := await deltas._next_delta()) is not None:
            out.append(delta)
        return out

    text = "".join(asyncio.run(read()))
    assert text == "Hello " and deltas.token_ids == ids[:kept] and deltas.finish_reason is FinishReason.STOP
    assert Tokens.aborted == ["r"]
