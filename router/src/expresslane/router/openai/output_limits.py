"""The output-length limits vLLM 0.32 applies, for the express lane (whose prefill leg runs with max_tokens=1, so
vLLM cannot apply them there); the native lane's decode server applies the same ones itself.

- requested max tokens: chat `max_completion_tokens`, else `max_tokens` (ChatCompletionRequest.build_tok_params);
  completions `max_tokens`, default 16 when the field is absent (CompletionRequest); explicit null = no limit;
- requested > max_model_len -> 400 "`param`=N cannot be greater than max_model_len=L. Please request fewer
  output tokens." (renderers/params.py TokenizeParams) before any work;
- the effective budget = min(max_model_len - prompt tokens, requested, else the generation_config's
  max_new_tokens) (entrypoints/serve/utils/api_utils.py get_max_tokens with default_sampling_params);
- min_tokens > effective -> 400 "min_tokens must be less than or equal to max_tokens=E, got M."
  (SamplingParams._verify_args), known only once the prefill reply gave the prompt length: the node's
  reservation is cancelled on that exit.
"""

from __future__ import annotations

from ..errors import VllmValidation
from .request import RequestOptions

__all__ = ["check_requested", "effective_max_tokens"]


def check_requested(opts: RequestOptions, max_model_len: int) -> None:
    n, param = opts.requested_max_tokens, opts.max_tokens_param
    if n is not None and n > max_model_len:
        raise VllmValidation(f"{param}={n} cannot be greater than max_model_len={max_model_len}. "
                             "Please request fewer output tokens.", param=param, value=n)


def effective_max_tokens(opts: RequestOptions, max_model_len: int, n_prompt: int,
                         default_max_tokens: int | None = None) -> int:
    n = opts.requested_max_tokens
    if n is None:
        n = default_max_tokens  # the model's generation_config max_new_tokens, as vLLM falls back to it
    eff = max_model_len - n_prompt if n is None else min(max_model_len - n_prompt, n)
    if eff < 1:
        raise VllmValidation(f"max_tokens must be at least 1, got {eff}.", param="max_tokens", value=eff)
    min_tokens = opts.min_tokens
    if min_tokens > eff:
        raise VllmValidation(f"min_tokens must be less than or equal to max_tokens={eff}, got {min_tokens}.")
    return eff
