"""Use a llumdask cluster started with Dask's own command line, from any Python process.

Start the scheduler and one worker per instance (here the sim engine drawing tokens from the
offline tiny model's vocabulary; a vLLM deployment sets ``DASK_LLUMDASK__ENGINE=vllm`` and its
model instead):

    dask scheduler --preload llumdask.plugins.scheduler
    DASK_LLUMDASK__SIM_ENGINE__VOCAB_SIZE=512 \\
        dask worker tcp://SCHEDULER:8786 --nthreads 1 --preload llumdask.plugins.worker

then:

    python examples/existing_cluster.py tcp://SCHEDULER:8786
"""

from __future__ import annotations

import sys

import llumdask


def main(address: str) -> None:
    with llumdask.connect(address) as llm:
        print(llm.instances())
        result = llm.generate("Once upon a time", max_tokens=16)
        print(f"text: {result.text!r}")
        print(f"usage: {result.usage}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tcp://127.0.0.1:8786")
