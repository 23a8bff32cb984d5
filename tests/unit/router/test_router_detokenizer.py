"""Incremental detokenization (UTF-8 boundaries, prompt priming) and vLLM's finishing rules."""

from __future__ import annotations

import json

import pytest

from expresslane.router.detokenizer import IncrementalDetokenizer, OutputAssembler, load_model_text


def stream_text(tok, ids, prompt=()):
    d = IncrementalDetokenizer(tok, list(prompt))
    pieces = [d.push(t) for t in ids]
    return pieces


@pytest.mark.parametrize("text", ["hello world, hello router", "naïve café — 東京 🦙 ok", "🦙🦙 multi-byte only"])
def test_incremental_text_equals_full_decode_and_never_shows_a_split_character(tokenizer, text):
    ids = tokenizer.encode(text).ids
    pieces = stream_text(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_multibyte_characters_are_split_over_tokens_in_this_tokenizer(tokenizer):
    # Guard for the test above: the llama emoji is several byte tokens, so boundaries really are exercised.
    ids = tokenizer.encode("🦙").ids
    assert len(ids) > 1
    pieces = stream_text(tokenizer, ids)
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "🦙"


def test_priming_with_the_prompt_keeps_the_first_tokens_spacing(tokenizer):
    prompt = tokenizer.encode("once upon a time").ids
    out = tokenizer.encode(" there was").ids
    assert "".join(stream_text(tokenizer, out, prompt)) == " there was"


def assembler(tokenizer, **kw):
    kw.setdefault("max_tokens", 100)
    return OutputAssembler(IncrementalDetokenizer(tokenizer, []), **kw)


def test_stop_string_truncates_and_is_held_back_while_streaming(tokenizer):
    ids = tokenizer.encode("hello world STOP now").ids
    asm = assembler(tokenizer, stop=["STOP"])
    sent = [asm.push([t]) for t in ids]
    assert asm.finished and asm.finish_reason == "stop" and asm.stop_reason == "STOP"
    assert "".join(sent) + asm.finish(None) == "hello world "
    assert not any("ST" in s for s in sent)  # the possible start of a stop string was never sent early
    assert len(asm.token_ids) < len(ids)  # tokens after the stop are not consumed


def test_include_stop_str_in_output_keeps_the_stop_string(tokenizer):
    asm = assembler(tokenizer, stop=["STOP"], include_stop_str_in_output=True)
    text = asm.push(tokenizer.encode("hello STOP now").ids)
    assert text + asm.finish(None) == "hello STOP"


def test_eos_and_stop_token_ids_finish_with_stop_and_no_text(tokenizer, eos_id):
    hello = tokenizer.encode("hello").ids
    asm = assembler(tokenizer, eos_token_ids=[eos_id])
    assert asm.push(hello + [eos_id] + hello) + asm.finish(None) == "hello"
    assert (asm.finish_reason, asm.stop_reason, asm.token_ids) == ("stop", None, hello + [eos_id])
    world = tokenizer.encode(" world").ids
    asm = assembler(tokenizer, stop_token_ids=[world[0]])
    asm.push(hello + world)
    assert (asm.finish_reason, asm.stop_reason, asm.text) == ("stop", world[0], "hello")


def test_ignore_eos_and_min_tokens_suppress_stopping(tokenizer, eos_id):
    hello = tokenizer.encode("hello").ids
    asm = assembler(tokenizer, eos_token_ids=[eos_id], ignore_eos=True, max_tokens=len(hello) + 2)
    asm.push(hello + [eos_id, eos_id])
    assert asm.finish_reason == "length" and len(asm.token_ids) == len(hello) + 2
    asm = assembler(tokenizer, eos_token_ids=[eos_id], min_tokens=2)
    asm.push([eos_id] + hello + [eos_id])
    assert asm.finish_reason == "stop" and asm.token_ids == [eos_id] + hello + [eos_id]


def test_max_tokens_finishes_with_length(tokenizer):
    ids = tokenizer.encode("the quick brown fox jumps").ids
    asm = assembler(tokenizer, max_tokens=2)
    text = asm.push(ids)
    assert asm.finish_reason == "length" and asm.token_ids == ids[:2]
    assert text == tokenizer.decode(ids[:2])


def test_node_finish_reason_is_used_when_the_router_saw_no_stop(tokenizer):
    asm = assembler(tokenizer)
    asm.push(tokenizer.encode("hello").ids)
    assert asm.finish("length") == "" and asm.finish_reason == "length"
    asm = assembler(tokenizer)
    asm.push(tokenizer.encode("hello").ids)
    asm.finish("stop")
    assert asm.finish_reason == "stop"


def test_load_model_text_reads_eos_and_sampling_defaults(tmp_path, tokenizer, eos_id):
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos_id, 3], "temperature": 0.6,
                                                                  "top_p": 0.9, "do_sample": True}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|bos|>"}))
    mt = load_model_text(tmp_path)
    assert mt.eos_token_ids == {eos_id, 3, tokenizer.token_to_id("<|bos|>")}
    assert mt.generation_defaults == {"temperature": 0.6, "top_p": 0.9}
    assert mt.tokenizer.decode(tokenizer.encode("hello").ids) == "hello"


def test_load_model_text_without_tokenizer_json_fails_loudly(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_model_text(tmp_path)
