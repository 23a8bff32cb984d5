"""Structured outputs through xgrammar, compiled exactly as vLLM 0.32's xgrammar backend compiles them.

Mirror of `vllm/v1/structured_output/backend_xgrammar.py` (the native lane's and the prefill's backend):

* one `xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=<the model's vocab size>)` per node, from the
  model directory's tokenizer, and one `xgr.GrammarCompiler(info, max_threads=8, cache_enabled=True)`;
* the request's constraint becomes vLLM's structured-output key (`get_structured_output_key`): a `json` schema
  object is `json.dumps`ed, `choice` becomes the EBNF `root ::= "a" | "b"` (`choice_as_grammar`), a `grammar`
  that has no `::=` line is Lark (`grammar_is_likely_lark`);
* the same compile call per kind: `compile_json_schema(spec, any_whitespace=not disable_any_whitespace,
  separators=(",", ":") if disable_any_whitespace else None)` for json and json_object (`{"type": "object"}`),
  `compile_regex`, `compile_grammar` / `compile_lark`, `compile_structural_tag` (the legacy `structures` +
  `triggers` form too);
* the matcher's stop tokens are the request's `all_stop_token_ids` (the model's eos ids plus stop_token_ids):
  `GrammarMatcher(ctx, override_stop_tokens=...)`. Once the grammar is complete only those are allowed, so a
  constrained request ends with finish_reason "stop"; after the matcher terminates nothing is masked (vLLM
  fills a full mask for a terminated grammar).

`disable_any_whitespace` is the node's setting, as in vLLM where it is the server's
`structured_outputs_config.disable_any_whitespace` (default False): the per-request option of the same name,
like `disable_additional_properties` and `whitespace_pattern`, is accepted and not used by vLLM's xgrammar
backend, so it is not used here either (the outputs stay identical to the native lane's).

Compilation runs once per request, before the node waits for the KV, off the token loop; an uncompilable
spec is a `GrammarError` (the server's 400 invalid_parameter). Per token the matcher fills a CPU bitmask
(`fill_next_token_bitmask`), which is copied to the logits' device and applied there with
`xgr.apply_token_bitmask_inplace`; the sampled token (which the engine reads back once per step anyway) is
then accepted into the matcher.

Speculation: the verify rows are masked through the matcher (row i is the mask after drafts d1..di, filled
by accepting the drafts one by one and rolling the matcher back), so greedy output with speculation equals
the output without it; a draft the grammar refuses ends the masking there (the target cannot emit it).
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import xgrammar as xgr

BACKEND = "xgrammar"
# vLLM bounds regex compilation (VLLM_REGEX_COMPILATION_TIMEOUT_S); the node bounds every compile the same way.
COMPILE_TIMEOUT_S = 10.0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def _xgr():
    """xgrammar, imported when a node builds its compiler (the engine itself imports without it)."""
    import xgrammar

    return xgrammar


class GrammarError(ValueError):
    """The structured-output spec cannot be compiled (or breaks the request's first token)."""


class StructuredOutputKind(str, enum.Enum):
    """vLLM's StructuredOutputOptions."""

    JSON = "json"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"
    STRUCTURAL_TAG = "structural_tag"


@dataclass(frozen=True)
class StructuredOutputSpec:
    """One request's constraint as vLLM's structured-output key: (kind, spec string)."""

    kind: StructuredOutputKind
    spec: str

    @classmethod
    def from_params(cls, *, json: str | dict | None = None, regex: str | None = None,
                    choice: list[str] | None = None, grammar: str | None = None, json_object: bool | None = None,
                    structural_tag: str | None = None) -> "StructuredOutputSpec":
        """vLLM's StructuredOutputsParams fields (exactly one constraint) -> its key (get_structured_output_key)."""
        given = {k: v for k, v in (("json", json), ("regex", regex), ("choice", choice), ("grammar", grammar),
                                    ("json_object", json_object), ("structural_tag", structural_tag))
                 if v is not None}
        if len(given) != 1:
            which = ", ".join(given) or "none"
            raise GrammarError(f"structured_outputs needs exactly one constraint of json, regex, choice, grammar, "
                               f"json_object, structural_tag; got {which}")
        if json is not None:
            return cls(StructuredOutputKind.JSON, json if isinstance(json, str) else _json.dumps(json))
        if json_object is not None:
            if json_object is not True:
                raise GrammarError("structured_outputs.json_object must be true")
            return cls(StructuredOutputKind.JSON_OBJECT, "")
        if regex is not None:
            if "\x00" in regex:
                raise GrammarError("structured_outputs.regex must not contain a NUL character ('\\x00')")
            return cls(StructuredOutputKind.REGEX, regex)
        if choice is not None:
            return cls(StructuredOutputKind.GRAMMAR, choice_as_grammar(choice))  # vLLM's validate step
        if grammar is not None:
            return cls(StructuredOutputKind.GRAMMAR, grammar)
        return cls(StructuredOutputKind.STRUCTURAL_TAG, structural_tag)


_json = json  # from_params has a parameter named json


def choice_as_grammar(choice: Sequence[str]) -> str:
    """vLLM's choice_as_grammar (vllm/v1/structured_output/utils.py)."""
    escapes = {"\\": r"\\", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}

    def escape_char(ch: str) -> str:
        if ch in escapes:
            return escapes[ch]
        if ord(ch) < 0x20 or ord(ch) == 0x7F:
            return f"\\u{ord(ch):04x}"
        return ch

    return "root ::= " + " | ".join(f'"{"".join(escape_char(ch) for ch in c)}"' for c in choice)


def grammar_is_likely_lark(grammar_str: str) -> bool:
    """vLLM's grammar_is_likely_lark: no `::=` rule line means Lark."""
    if not grammar_str or not isinstance(grammar_str, str):
        return False
    for line in grammar_str.split("\n"):
        line = re.sub(r"(#|//).*$", "", line).strip()
        if line and "::=" in line:
            return False
    return True


class GrammarCompiler:
    """The node's compiler: vLLM's XgrammarBackend.__post_init__ + compile_grammar."""

    def __init__(self, tokenizer_info: "xgr.TokenizerInfo", vocab_size: int, *,
                 disable_any_whitespace: bool = False) -> None:
        self.vocab_size = vocab_size
        self.disable_any_whitespace = disable_any_whitespace
        self.compiler = _xgr().GrammarCompiler(tokenizer_info, max_threads=8, cache_enabled=True)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="expresslane-grammar")

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, vocab_size: int, *,
                       disable_any_whitespace: bool = False) -> "GrammarCompiler":
        """TokenizerInfo from the model directory's Hugging Face tokenizer, sized to the model's vocab."""
        from transformers import AutoTokenizer

        files = [f for f in TOKENIZER_FILES if (Path(model_dir) / f).is_file()]
        if not files:  # transformers would build an empty tokenizer from the model config alone
            raise GrammarError(f"{model_dir} has no tokenizer ({', '.join(TOKENIZER_FILES)})")
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        info = _xgr().TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        return cls(info, vocab_size, disable_any_whitespace=disable_any_whitespace)

    def compile(self, spec: StructuredOutputSpec, timeout_s: float = COMPILE_TIMEOUT_S) -> "xgr.CompiledGrammar":
        """Compile (bounded by timeout_s; xgrammar caches compiled grammars). GrammarError names the problem."""
        future = self._pool.submit(self._compile, spec)
        try:
            return future.result(timeout=timeout_s)
        except FutureTimeout:
            future.cancel()
            raise GrammarError(f"structured_outputs.{spec.kind.value}: compilation timed out after {timeout_s}s; "
                               "the pattern may be too complex") from None
        except GrammarError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError / ValueError with its parser's message
            raise GrammarError(f"structured_outputs.{spec.kind.value} cannot be compiled: "
                               f"{str(e).strip() or type(e).__name__}") from None

    def _compile(self, spec: StructuredOutputSpec) -> "xgr.CompiledGrammar":
        c, kind = self.compiler, spec.kind
        separators = (",", ":") if self.disable_any_whitespace else None
        if kind is StructuredOutputKind.JSON:
            try:
                json.loads(spec.spec)
            except json.JSONDecodeError as e:
                raise GrammarError(f"Invalid JSON grammar specification: {e}") from None
            return c.compile_json_schema(spec.spec, any_whitespace=not self.disable_any_whitespace,
                                         separators=separators)
        if kind is StructuredOutputKind.JSON_OBJECT:
            return c.compile_json_schema('{"type": "object"}', any_whitespace=not self.disable_any_whitespace,
                                         separators=separators)
        if kind is StructuredOutputKind.GRAMMAR:
            return c.compile_lark(spec.spec) if grammar_is_likely_lark(spec.spec) else c.compile_grammar(spec.spec)
        if kind is StructuredOutputKind.REGEX:
            return c.compile_regex(spec.spec)
        if kind is StructuredOutputKind.STRUCTURAL_TAG:
            s_tag = json.loads(spec.spec)
            if "structures" in s_tag:  # the deprecated form, as vLLM still accepts it
                tags = [_xgr().StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                        for s in s_tag["structures"]]
                return c.compile_structural_tag(tags, s_tag["triggers"])
            return c.compile_structural_tag(spec.spec)
        raise GrammarError(f"unknown structured output kind {kind!r}")

    def matcher(self, compiled: "xgr.CompiledGrammar", stop_token_ids: Iterable[int]) -> "RequestGrammar":
        return RequestGrammar(compiled, stop_token_ids, self.vocab_size)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class RequestGrammar:
    """One request's matcher state and its bitmask buffers (vLLM's XgrammarGrammar)."""

    def __init__(self, compiled: "xgr.CompiledGrammar", stop_token_ids: Iterable[int], vocab_size: int) -> None:
        stop = sorted({int(t) for t in stop_token_ids})
        self.matcher = _xgr().GrammarMatcher(compiled, override_stop_tokens=stop or None)
        self.vocab_size = vocab_size
        self.terminated = False
        self.num_accepted = 0
        self._host: torch.Tensor | None = None  # [rows, ceil(vocab / 32)] int32 on the CPU
        self._device: torch.Tensor | None = None

    def accept(self, token: int) -> bool:
        """Advance by one emitted token (vLLM's accept_tokens: tokens after termination are ignored)."""
        if self.terminated:
            return True
        if not self.matcher.accept_token(int(token)):
            return False
        self.num_accepted += 1
        self.terminated = self.matcher.is_terminated()
        return True

    def _buffers(self, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._host is None or self._host.shape[0] < rows:
            self._host = _xgr().allocate_token_bitmask(rows, self.vocab_size)
            if device.type == "cuda":
                self._host = self._host.pin_memory()
                self._device = torch.empty_like(self._host, device=device)
            else:
                self._device = self._host
        return self._host, self._device

    def apply(self, logits: torch.Tensor, drafts: Sequence[int] = ()) -> None:
        """Mask logits [T, vocab] in place: row i allows what the grammar allows after drafts[:i]
        (T = len(drafts) + 1). The matcher ends in the state it started in."""
        rows = logits.shape[0]
        host, device = self._buffers(rows, logits.device)
        host[:rows].fill_(-1)  # all allowed: rows past a refused draft, and a terminated grammar
        accepted = 0
        terminated = self.terminated
        for i in range(rows):
            if not terminated:
                self.matcher.fill_next_token_bitmask(host, i)
            if i == rows - 1 or terminated:
                break
            if not self.matcher.accept_token(int(drafts[i])):
                break  # row i forbids drafts[i]: verification stops there
            accepted += 1
            terminated = self.matcher.is_terminated()
        if accepted:
            self.matcher.rollback(accepted)
        if device is not host:
            device[:rows].copy_(host[:rows], non_blocking=True)
        _xgr().apply_token_bitmask_inplace(logits, device[:rows], vocab_size=self.vocab_size)

