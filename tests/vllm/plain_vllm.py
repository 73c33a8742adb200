"""Greedy outputs from an unmodified `vllm.LLM`, run in its own process (vLLM's defaults, no
llumdask code, no connector): the reference llumdask's engine must reproduce token for token.

Usage: python plain_vllm.py MODEL_DIR ENGINE_ARGS_JSON PROMPTS_JSON [BEAMS_JSON] -> JSON list of
token lists (then log probabilities and how each ended, tagged lines). PROMPTS_JSON is a list of [prompt token ids, max_tokens] or [prompt token ids,
max_tokens, {more vLLM sampling parameters}]; BEAMS_JSON a list of [prompt token ids, {vLLM's
BeamSearchParams}], each searched by vLLM's own beam search (its best beams' generated tokens and
summed log probabilities).
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
    # Where asked for: [own logprob, [[token id, logprob] of the top ones by rank], own rank, own
    # decoded text, [[token id, logprob] of every entry, in vLLM's order]] per position; and how
    # each output ended, with its text.
    print("PLAIN-VLLM-LOGPROBS " + json.dumps([
        {"logprobs": positions(o.outputs[0].logprobs, o.outputs[0].token_ids, len(prompt) > 2 and prompt[2].get("logprobs")),
         "prompt_logprobs": positions(o.prompt_logprobs, prompt[0], len(prompt) > 2 and prompt[2].get("prompt_logprobs")),
         "finish_reason": o.outputs[0].finish_reason, "stop_reason": o.outputs[0].stop_reason, "text": o.outputs[0].text}
        for o, prompt in zip(outputs, prompts)]))
    if len(sys.argv) > 4:
        from vllm.sampling_params import BeamSearchParams

        print("PLAIN-VLLM-BEAMS " + json.dumps([
            [[beam.tokens[len(ids):], beam.cum_logprob] for beam in
             llm.beam_search([TokensPrompt(prompt_token_ids=ids)], BeamSearchParams(**params))[0].sequences]
            for ids, params in json.loads(sys.argv[4])]))


def positions(logprobs, token_ids, top):
    if not logprobs:
        return None
    top = top or 0  # none by rank where the request named its tokens (logprob_token_ids)
    return [None if position is None else
            [position[token].logprob, [[t, lp.logprob] for t, lp in sorted(position.items(), key=lambda kv: kv[1].rank)
                                       if lp.rank <= top], position[token].rank, position[token].decoded_token,
             [[t, lp.logprob] for t, lp in position.items()]]
            for position, token in zip(logprobs, token_ids)]


def options(more: dict | None = None) -> dict:
    """More sampling parameters from JSON, whose object keys are strings: logit_bias takes ids;
    repetition_detection is vLLM's parameters object."""
    more = dict(more or {})
    if "logit_bias" in more:
        more["logit_bias"] = {int(t): b for t, b in more["logit_bias"].items()}
    if "repetition_detection" in more:
        from vllm.sampling_params import RepetitionDetectionParams

        more["repetition_detection"] = RepetitionDetectionParams(**more["repetition_detection"])
    return more


if __name__ == "__main__":
    main()
