"""Structured outputs on the express engine (decode/grammar.py): the xgrammar mask really constrains the tiny model,
the output parses and ends with stop, speculation stays exact under a grammar, and the tokens equal a transformers
float32 reference decoded under an independent matcher."""

from __future__ import annotations

import json
import re

import pytest

from expresslane.engine.decode.grammar import (GrammarError, StructuredOutputKind, StructuredOutputSpec,
                                               choice_as_grammar, grammar_is_likely_lark)

from .test_grammar_fixtures import (PERSON, compiler, engine, hf, hf_reference, prompt_ids, run,  # noqa: F401
                                    spec_engine, tiny_dir, tokenizer)


def text_of(tokenizer, gen) -> str:
    toks = gen.token_ids[:-1] if gen.finish_reason == "stop" else gen.token_ids
    return tokenizer.decode(toks)


def test_unconstrained_output_violates_the_schema_constrained_output_parses(engine, compiler, tokenizer):
    prompt = prompt_ids(tokenizer)
    free = run(engine, None, prompt, None, max_tokens=40, ignore_eos=True)
    with pytest.raises(json.JSONDecodeError):
        json.loads(text_of(tokenizer, free))  # the tiny model does not write JSON on its own
    gen = run(engine, compiler, prompt, StructuredOutputSpec.from_params(json=PERSON), max_tokens=200)
    assert gen.finish_reason == "stop" and gen.token_ids[-1] in engine.eos_token_ids
    obj = json.loads(text_of(tokenizer, gen))
    assert set(obj) == {"name", "age"} and isinstance(obj["name"], str) and isinstance(obj["age"], int)
    assert len(obj["name"]) <= 12 and 0 <= obj["age"] <= 999


def test_tokens_equal_a_transformers_reference_under_an_independent_matcher(engine, compiler, tokenizer, hf):
    prompt = prompt_ids(tokenizer, "The person record is ")
    spec = StructuredOutputSpec.from_params(json=PERSON)
    gen = run(engine, compiler, prompt, spec, max_tokens=120)
    ref, _ = hf_reference(hf, compiler, prompt, spec, 120, engine.eos_token_ids)
    assert gen.token_ids == ref


@pytest.mark.parametrize("kind, fields, check", [
    ("regex", {"regex": r"[a-z]{3,6}-[0-9]{2}"}, lambda t: re.fullmatch(r"[a-z]{3,6}-[0-9]{2}", t)),
    ("choice", {"choice": ["yes", "no", "maybe so"]}, lambda t: t in ("yes", "no", "maybe so")),
    ("ebnf", {"grammar": 'root ::= "x" [0-9] [0-9] "!"'}, lambda t: re.fullmatch(r"x[0-9]{2}!", t)),
    ("lark", {"grammar": 'start: "ab" DIGIT\n%import common.DIGIT'}, lambda t: re.fullmatch(r"ab[0-9]", t)),
    ("json_object", {"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
])
def test_each_kind_constrains_and_terminates_with_stop(engine, compiler, tokenizer, kind, fields, check):
    gen = run(engine, compiler, prompt_ids(tokenizer, "Answer: "), StructuredOutputSpec.from_params(**fields),
              max_tokens=200)
    assert gen.finish_reason == "stop", (kind, text_of(tokenizer, gen))
    assert check(text_of(tokenizer, gen)), (kind, text_of(tokenizer, gen))


def test_structural_tag_constrains_the_tagged_part(engine, compiler, tokenizer):
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<x>", "end": "</x>",
                                                "content": {"type": "json_schema", "json_schema": PERSON}}}
    gen = run(engine, compiler, prompt_ids(tokenizer), StructuredOutputSpec.from_params(structural_tag=json.dumps(tag)),
              max_tokens=200)
    text = text_of(tokenizer, gen)
    assert gen.finish_reason == "stop" and text.startswith("<x>") and text.endswith("</x>"), text
    assert set(json.loads(text[3:-4])) == {"name", "age"}


def test_greedy_with_speculation_equals_without_under_a_grammar(engine, spec_engine, compiler, tokenizer):
    # A repetitive constrained output so prompt lookup drafts (and some drafts are kept, some refused)
    spec = StructuredOutputSpec.from_params(regex=r"(ab ){6}(cd ){6}[a-z]{4}")
    prompt = prompt_ids(tokenizer, "ab ab ab cd cd cd ")
    off = run(engine, compiler, prompt, spec, max_tokens=80)
    on = run(spec_engine, compiler, prompt, spec, max_tokens=80, prompt_token_ids=tuple(prompt))
    assert on.token_ids == off.token_ids and on.finish_reason == off.finish_reason == "stop"
    assert on.spec.verify_steps > 0 and on.spec.accepted_tokens > 0, on.spec.as_dict()
    schema = StructuredOutputSpec.from_params(json=PERSON)
    p2 = prompt_ids(tokenizer)
    assert run(spec_engine, compiler, p2, schema, max_tokens=120, prompt_token_ids=tuple(p2)).token_ids == \
        run(engine, compiler, p2, schema, max_tokens=120).token_ids


def test_grammar_refusing_the_first_token_is_an_error(engine, compiler, tokenizer):
    prompt = prompt_ids(tokenizer)
    engine.prefill(prompt)
    grammar = compiler.matcher(compiler.compile(StructuredOutputSpec.from_params(choice=["yes"])), engine.eos_token_ids)
    no = tokenizer.encode("no", add_special_tokens=False)[0]
    from expresslane.engine.decode import SamplingParams
    with pytest.raises(GrammarError, match="first_token_id"):
        engine.generate(no, len(prompt), SamplingParams(max_tokens=4), grammar=grammar)


@pytest.mark.parametrize("fields, needle", [
    ({"json": "{not json"}, "Invalid JSON"),
    ({"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "json"),
    ({"regex": "(unclosed"}, "regex"),
    ({"grammar": "root ::= missing_rule"}, "grammar"),
    ({"structural_tag": '{"type": "structural_tag", "format": {"type": "bogus"}}'}, "structural_tag"),
])
def test_uncompilable_specs_name_the_problem(compiler, fields, needle):
    with pytest.raises(GrammarError, match=needle):
        compiler.compile(StructuredOutputSpec.from_params(**fields))


def test_spec_mirrors_vllms_structured_output_key():
    assert StructuredOutputSpec.from_params(json={"type": "object"}) == \
        StructuredOutputSpec(StructuredOutputKind.JSON, '{"type": "object"}')
    assert StructuredOutputSpec.from_params(choice=['a"b', "c"]).spec == 'root ::= "a\\"b" | "c"'
    assert choice_as_grammar(["x\ny"]) == 'root ::= "x\\ny"'
    assert grammar_is_likely_lark("start: 'a'") and not grammar_is_likely_lark("root ::= 'a'")
    for bad in ({}, {"regex": "a", "choice": ["b"]}, {"json_object": False}, {"regex": "a\x00"}):
        with pytest.raises(GrammarError):
            StructuredOutputSpec.from_params(**bad)


def test_vllm_agrees_on_the_key_and_choice_grammar():
    """The mirrored helpers equal vLLM's own (the dev venv has vLLM; the engine image need not)."""
    vutils = pytest.importorskip("vllm.v1.structured_output.utils")
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.structured_output.request import get_structured_output_key

    assert choice_as_grammar(["yes", "no"]) == vutils.choice_as_grammar(["yes", "no"])
    # Control characters: vLLM 0.32 (the CPU images) escapes a tab as \t, vLLM 0.26 (the GPU carry) leaves it raw;
    # the two grammars are one language, which xgrammar's normal form shows (and ours is the escaped one).
    import xgrammar as xg

    odd = ['q"uote', "back\\slash", "tab\there"]
    ours, theirs = choice_as_grammar(odd), vutils.choice_as_grammar(odd)
    assert "\t" not in ours and str(xg.Grammar.from_ebnf(ours)) == str(xg.Grammar.from_ebnf(theirs))
    for g in ("start: 'a'", "root ::= 'a'", "# c\nroot ::= x"):
        assert grammar_is_likely_lark(g) == vutils.grammar_is_likely_lark(g)
    for fields in ({"json": {"type": "object", "properties": {"b": {}, "a": {}}}}, {"regex": "a+"},
                   {"grammar": "root ::= 'a'"}, {"structural_tag": "{}"}):
        kind, spec = get_structured_output_key(StructuredOutputsParams(**fields))
        ours = StructuredOutputSpec.from_params(**fields)
        assert (ours.kind.value, ours.spec) == (kind.name.lower(), spec)
