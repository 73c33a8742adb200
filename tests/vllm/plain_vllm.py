"""Greedy outputs from an unmodified `vllm.LLM`, run in its own process (vLLM's defaults, no
llumdask code, no connector): the reference llumdask's engine must reproduce token for token.

Usage: python plain_vllm.py MODEL_DIR ENGINE_ARGS_JSON PROMPTS_JSON -> JSON list of token lists.
PROMPTS_JSON is a list of [prompt token ids, max_tokens] or [prompt token ids, max_tokens, {more
vLLM sampling parameters}].
"""

import json
import os
import sys


def main() -> None:
    # The engine core in this process, as llumdask's engine runs it: one vLLM start, not two.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams, TokensPrompt

    model, engine_args, prompts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    llm = LLM(model=model, enforce_eager=True, **engine_args)
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=ids) for ids, *_ in prompts],
        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **options(*more)) for _, n, *more in prompts],
        use_tqdm=False,
    )
    print("PLAIN-VLLM-OUTPUT " + json.dumps([list(o.outputs[0].token_ids) for o in outputs]))


def options(more: dict | None = None) -> dict:
    """More sampling parameters from JSON, whose object keys are strings: logit_bias takes ids."""
    more = dict(more or {})
    if "logit_bias" in more:
        more["logit_bias"] = {int(t): b for t, b in more["logit_bias"].items()}
    return more


if __name__ == "__main__":
    main()
