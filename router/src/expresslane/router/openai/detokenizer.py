"""Express-lane detokenization: token ids from the decode node -> text deltas, stop rules, finish reason.

`IncrementalDetokenizer` is what vLLM's fast path does (FastIncrementalDetokenizer in
vllm/v1/engine/detokenizer.py): a `tokenizers.decoders.DecodeStream` primed with the prompt's token ids,
stepped once per token; it returns text only when the newest tokens complete a character (a multi-byte
character split across byte tokens yields nothing until its last byte), and the priming gives the first
generated token the same leading-space treatment it gets inside vLLM. Same recovery as vLLM's for the
"Invalid prefix" error (a new stream), and the same handling of an invalid id (no text).

`OutputAssembler` applies vLLM's finishing rules on top: EOS (unless `ignore_eos`) and
`stop_token_ids` finish with "stop" (their text is not emitted unless `include_stop_str_in_output`),
stop strings truncate the text and finish with "stop" (text that could still become a stop string is
held back while streaming), `max_tokens` finishes with "length"; `min_tokens` suppresses all of them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["IncrementalDetokenizer", "ModelText", "OutputAssembler", "load_model_text"]

logger = logging.getLogger(__name__)

# tokenizers' message when its stream state breaks (tokenizers src/tokenizer/mod.rs; vLLM matches the same)
_INVALID_PREFIX = "Invalid prefix encountered"


@dataclass(frozen=True)
class ModelText:
    """What the router needs from the model directory: the tokenizer, EOS ids, sampling defaults."""

    tokenizer: Any
    eos_token_ids: frozenset[int] = frozenset()
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    default_max_tokens: int | None = None  # generation_config max_new_tokens (vLLM's default_sampling_params)


# vLLM 0.32's ModelConfig.get_diff_sampling_param (--generation-config auto, the default): the keys it takes from
# generation_config.json as defaults for what a request leaves unset; max_new_tokens becomes max_tokens.
_DEFAULT_KEYS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k", "top_p",
                 "min_p")


def _ids(value: Any) -> set[int]:
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int)}
    return set()


def load_model_text(model_dir: str | Path) -> ModelText:
    """Load tokenizer.json (with the `tokenizers` library) and the EOS ids / sampling defaults that
    vLLM itself would use (generation_config.json, config.json, tokenizer_config.json)."""
    from tokenizers import Tokenizer as HFTokenizer

    d = Path(model_dir)
    tok_file = d / "tokenizer.json"
    if not tok_file.is_file():
        raise FileNotFoundError(f"tokenizer_dir {d}: no tokenizer.json (the express lane detokenizes with it)")
    tokenizer = HFTokenizer.from_file(str(tok_file))

    def read(name: str) -> dict:
        p = d / name
        if not p.is_file():
            return {}
        data = json.loads(p.read_text())
        return data if isinstance(data, dict) else {}

    gen, cfg, tcfg = read("generation_config.json"), read("config.json"), read("tokenizer_config.json")
    eos = _ids(gen.get("eos_token_id")) | _ids(cfg.get("eos_token_id"))
    eos_tok = tcfg.get("eos_token")
    if isinstance(eos_tok, dict):
        eos_tok = eos_tok.get("content")
    if isinstance(eos_tok, str) and tokenizer.token_to_id(eos_tok) is not None:
        eos.add(tokenizer.token_to_id(eos_tok))
    defaults = {k: gen[k] for k in _DEFAULT_KEYS if gen.get(k) is not None}
    max_new = gen.get("max_new_tokens")
    return ModelText(tokenizer, frozenset(eos), defaults,
                     max_new if isinstance(max_new, int) and not isinstance(max_new, bool) else None)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream

        self._tok = tokenizer  # a tokenizers.Tokenizer (what load_model_text gives)
        self._skip = skip_special_tokens
        self._new_stream = DecodeStream
        self._stream = DecodeStream(ids=list(prompt_ids), skip_special_tokens=skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ('' while a character is still split)."""
        try:
            text = self._stream.step(self._tok, token_id)
        except (OverflowError, TypeError):
            logger.error("express detokenizer: invalid token id %r (no text)", token_id)
            return ""
        except Exception as e:  # tokenizers raises a plain Exception for this one
            if not str(e).startswith(_INVALID_PREFIX):
                raise
            # Non-monotonic UTF-8 output broke the stream's state (vLLM issue 17448): start a new one.
            logger.warning("express detokenizer: invalid prefix; resetting the decode stream")
            self._stream = self._new_stream(skip_special_tokens=self._skip)
            text = self._stream.step(self._tok, token_id)
        return text or ""


class OutputAssembler:
    def __init__(self, detok: IncrementalDetokenizer, *, max_tokens: int, stop: Iterable[str] = (),
                 stop_token_ids: Iterable[int] = (), eos_token_ids: Iterable[int] = (), ignore_eos: bool = False,
                 min_tokens: int = 0, include_stop_str_in_output: bool = False):
        self._detok = detok
        self.max_tokens = max_tokens
        self.stop = [s for s in stop if s]
        self.stop_token_ids = set(stop_token_ids)
        self.eos_token_ids = set() if ignore_eos else set(eos_token_ids)
        self.min_tokens = min_tokens
        self.include_stop = include_stop_str_in_output
        self._hold = 0 if not self.stop or self.include_stop else max(len(s) for s in self.stop) - 1
        self.token_ids: list[int] = []
        self.text = ""
        self._sent = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def push(self, ids: Iterable[int]) -> str:
        """Consume token ids (ignoring any after the finish); return the text that may be sent now."""
        for t in ids:
            if self.finished:
                break
            self._push_one(int(t))
        return self._take()

    def finish(self, node_reason: str | None) -> str:
        """The node ended the stream: settle the finish reason, return the held-back text."""
        if not self.finished:
            if len(self.token_ids) >= self.max_tokens:
                self.finish_reason = "length"
            else:
                self.finish_reason = "length" if node_reason == "length" else "stop"
        return self._take()

    def _push_one(self, t: int) -> None:
        self.token_ids.append(t)
        n = len(self.token_ids)
        past_min = n > self.min_tokens
        is_eos = past_min and t in self.eos_token_ids
        is_stop_id = past_min and t in self.stop_token_ids
        if is_eos or is_stop_id:
            if self.include_stop:
                self.text += self._detok.push(t)
            self.finish_reason = "stop"
            self.stop_reason = None if is_eos and not is_stop_id else t
            return
        delta = self._detok.push(t)
        if delta:
            self.text += delta
            if self.stop and past_min and self._check_stop_strings(len(delta)):
                return
        if n >= self.max_tokens:
            self.finish_reason = "length"

    def _check_stop_strings(self, new_chars: int) -> bool:
        # vLLM's check_stop_strings: of the stop strings found in the new text, the one that completes
        # earliest wins (ties: stop-list order).
        best: tuple[int, int, str] | None = None  # (end, index, stop string)
        for s in self.stop:
            idx = self.text.find(s, max(0, len(self.text) - new_chars - len(s) + 1))
            if idx != -1 and (best is None or idx + len(s) < best[0]):
                best = (idx + len(s), idx, s)
        if best is None:
            return False
        end, idx, s = best
        self.text = self.text[:end if self.include_stop else idx]
        self.finish_reason = "stop"
        self.stop_reason = s
        return True

    def _take(self) -> str:
        end = len(self.text) if self.finished else len(self.text) - self._hold
        if end <= self._sent:
            return ""
        out = self.text[self._sent:end]
        self._sent = end
        return out
