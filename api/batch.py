"""Batch inference over a Dask bag of prompts, as ordinary Dask tasks.

Each partition becomes one task that submits its prompts through a requester of its own, from
the worker it runs on (its worker client), so a notebook scores a large collection with one
call while the gateway and other clients keep being served: the requests are placed by the
same global scheduler, at the priority asked for (normal by default, so interactive
high-priority traffic keeps its headroom).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    import dask.bag

    from llumdask.api.client import Generation


def generate_bag(prompts: "dask.bag.Bag", *, model: str | None, chat_template: str | None,
                 options: dict[str, Any]) -> "dask.bag.Bag":
    """A bag with one `Generation` per prompt, in order (a failed prompt: its exception).
    `options` are `LlumdaskClient.generate`'s keywords."""
    return prompts.map_partitions(_generate_partition, model=model, chat_template=chat_template, options=options)


def _generate_partition(prompts: Iterable[Any], model: str | None, chat_template: str | None,
                        options: dict[str, Any]) -> list["Generation | BaseException"]:
    from distributed import get_client

    from llumdask.api.client import LlumdaskClient

    prompts = list(prompts)
    if not prompts:
        return []
    llm = LlumdaskClient(get_client(), model=model, chat_template=chat_template)
    try:
        return llm.generate(prompts, progress=False, **options)
    finally:
        llm.close()
