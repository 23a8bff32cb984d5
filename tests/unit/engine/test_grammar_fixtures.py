"""Fixtures and references shared by test_grammar*.py and test_logprobs*.py (no tests here).

The model is the project's tiny Llama (scripts/make_tiny_model.py): it has a real byte-level BPE tokenizer, which
xgrammar needs, and large top-1 margins. References are computed with transformers in float32 and with a second,
independent xgrammar matcher, so the engine's mask and logprobs are checked against code that is not the engine's.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xgrammar as xgr

from expresslane.engine.decode import DecodeEngine, SamplingParams
from expresslane.engine.decode.grammar import GrammarCompiler, StructuredOutputSpec
from expresslane.engine.decode.speculative import SpeculationConfig

REPO = Path(__file__).resolve().parents[3]
MAX_SEQ = 512
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), str(out), "--force"],
                   check=True, capture_output=True)
    return out


@pytest.fixture(scope="session")
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dir))


@pytest.fixture(scope="session")
def hf(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def compiler(tiny_dir, engine) -> GrammarCompiler:
    c = GrammarCompiler.from_model_dir(tiny_dir, engine.vocab_size)
    yield c
    c.close()


@pytest.fixture(scope="session")
def engine(tiny_dir) -> DecodeEngine:
    return DecodeEngine.from_pretrained(tiny_dir, max_seq_len=MAX_SEQ, speculation=None)


@pytest.fixture(scope="session")
def spec_engine(tiny_dir) -> DecodeEngine:
    return DecodeEngine.from_pretrained(tiny_dir, max_seq_len=MAX_SEQ, speculation=SpeculationConfig(k=4))


def prompt_ids(tokenizer, text: str = "Reply with a JSON object about a person: ") -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def first_token(engine: DecodeEngine, prompt: list[int], grammar=None) -> int:
    """What the prefill does: run the prompt and pick the (grammar-masked) greedy first token."""
    logits = engine.prefill(prompt)[None].clone()
    if grammar is not None:
        grammar.apply(logits)
    return int(logits.argmax())


def run(engine: DecodeEngine, compiler: GrammarCompiler | None, prompt: list[int], spec: StructuredOutputSpec | None,
        **sampling):
    """Prefill + decode one request on `engine`; returns the finished Generation."""
    grammar = compiler.matcher(compiler.compile(spec), engine.eos_token_ids) if spec is not None else None
    first = first_token(engine, prompt, grammar)
    sampling = {"max_tokens": 64, "temperature": 0.0, **sampling}
    gen = engine.generate(first, len(prompt), SamplingParams(**sampling), grammar=grammar)
    list(gen)
    return gen


def hf_reference(hf, compiler: GrammarCompiler | None, prompt: list[int], spec: StructuredOutputSpec | None,
                 max_tokens: int, eos: tuple[int, ...]) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding with transformers (float32, full forward per token) under an independent xgrammar matcher;
    returns the tokens and each step's float32 log_softmax of the masked logits (vLLM's raw_logprobs)."""
    matcher = xgr.GrammarMatcher(compiler.compile(spec), override_stop_tokens=list(eos)) if spec else None
    ids, out, lps = list(prompt), [], []
    bitmask = xgr.allocate_token_bitmask(1, hf.config.vocab_size)
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = hf(torch.tensor([ids])).logits[0, -1:].float()
            if matcher is not None and not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, 0)
                xgr.apply_token_bitmask_inplace(logits, bitmask)
            lps.append(logits[0].log_softmax(-1, dtype=torch.float32))
            tok = int(logits.argmax())
            out.append(tok)
            ids.append(tok)
            if matcher is not None:
                assert matcher.accept_token(tok)
            if tok in eos:
                break
    return out, lps
