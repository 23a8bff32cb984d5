"""The OpenAI surface: what a client's request means and what its answer looks like, as vLLM 0.32 serves them.

  shapes.py         light request validation, vLLM-shaped responses and chunks, SSE framing and parsing
  request.py        one typed view of the client's request (RequestOptions), read once
  detokenizer.py    incremental detokenizer (UTF-8 safe) + vLLM's stop / EOS / length rules
  logprobs.py       logprobs in vLLM's chat and completions shapes
  tools.py          tool calling as vLLM's hermes parser does it
  structured.py     the express node's structured_outputs, built as vLLM builds them
  output_limits.py  vLLM's output-length limits (max_model_len, min_tokens)
"""
