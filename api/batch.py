"""Batch inference over Dask collections of prompts (a bag, or a dataframe column), as ordinary Dask tasks.

Each partition becomes one task that submits its prompts through the requester of the worker it
runs on (one per worker process, through its worker client, kept for later partitions: each
would otherwise start a token listener and load the tokenizer again), so a notebook scores a
large collection with one call while the gateway and other clients keep being served: the
requests are placed by the same global scheduler, at the priority asked for (normal by
default, so interactive high-priority traffic keeps its headroom).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Iterable, NamedTuple

if TYPE_CHECKING:
    import dask.bag
    import dask.dataframe
    import pandas

    from llumdask.api.client import Generation, LlumdaskClient

# The columns a dataframe of prompts becomes: what Parquet and pandas users read results by.
COLUMNS = {"text": "string", "finish_reason": "string", "prompt_tokens": "int64", "completion_tokens": "int64",
           "error": "string"}

class Served(NamedTuple):
    """The served model as `connect` was told it: what a worker's client loads its tokenizer from."""

    model: str | None
    chat_template: str | None
    trust_remote_code: bool


# This process's clients for partitions, by what they serve; the worker's tasks share them.
_clients: dict[Served, "LlumdaskClient"] = {}
_clients_lock = threading.Lock()


def generate_bag(prompts: "dask.bag.Bag", *, served: Served, options: dict[str, Any]) -> "dask.bag.Bag":
    """A bag with one `Generation` per prompt, in order (a failed prompt: its exception).
    `options` are `LlumdaskClient.generate`'s keywords."""
    return prompts.map_partitions(_generate_partition, served=served, options=options)


def generate_column(prompts: "dask.dataframe.Series", *, served: Served,
                    options: dict[str, Any]) -> "dask.dataframe.DataFrame":
    """A frame with the prompts' index and one row per prompt (`COLUMNS`): its text, finish reason
    and token counts, or for a failed prompt its error (`Type: message`) and no text."""
    from dask.dataframe.utils import make_meta

    return prompts.map_partitions(_generate_frame, served=served, options=options,
                                  meta=_frame([], make_meta(prompts).index))


def _generate_frame(prompts: "pandas.Series", served: Served, options: dict[str, Any]) -> "pandas.DataFrame":
    results = _generate_partition(prompts.tolist(), served, options)
    return _frame([_row(r) for r in results], prompts.index)


def _row(result: "Generation | BaseException") -> tuple:
    if isinstance(result, BaseException):
        return None, None, 0, 0, f"{type(result).__name__}: {result}"
    reason = None if result.finish_reason is None else result.finish_reason.value
    return result.text, reason, result.num_prompt_tokens, len(result.token_ids), None


def _frame(rows: list[tuple], index: Any) -> "pandas.DataFrame":
    import pandas

    return pandas.DataFrame(rows, index=index, columns=list(COLUMNS)).astype(COLUMNS)


def _generate_partition(prompts: Iterable[Any], served: Served,
                        options: dict[str, Any]) -> list["Generation | BaseException"]:
    prompts = list(prompts)
    if not prompts:
        return []
    return worker_llm(served).generate_batch(prompts, progress=False, **options)


def worker_llm(served: Served) -> "LlumdaskClient":
    """The client partitions of this worker process submit through, made on first use: its
    requester serves the worker's concurrent tasks (its placements and streams run on the
    worker's event loop, as a gateway's serve many requests) until the process ends."""
    from distributed import get_client

    from llumdask.api.client import LlumdaskClient

    dask_client = get_client()
    with _clients_lock:
        llm = _clients.get(served)
        if llm is None or llm.dask_client is not dask_client:
            llm = _clients[served] = LlumdaskClient(dask_client, **served._asdict())
        return llm
