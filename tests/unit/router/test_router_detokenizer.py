"""Incremental detokenization (UTF-8 boundaries, prompt priming) and vLLM's finishing rules."""

from __future__ import annotations

import json

import pytest

from expresslane.router.openai.detokenizer import IncrementalDetokenizer, OutputAssembler, load_model_text


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
    assert mt.default_max_tokens is None
    assert mt.tokenizer.decode(tokenizer.encode("hello").ids) == "hello"


def test_generation_defaults_are_the_keys_vllm_takes(tmp_path, tokenizer):
    """The same defaults vLLM 0.32 derives from generation_config.json (ModelConfig.get_diff_sampling_param),
    max_new_tokens apart: the router keeps it as the default output budget."""
    from vllm.config.model import ModelConfig as VllmModelConfig

    gen = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
           "presence_penalty": 0.5, "frequency_penalty": 0.25, "max_new_tokens": 7, "do_sample": True,
           "typical_p": 0.9}
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    mt = load_model_text(tmp_path)

    class _Cfg:  # the attributes get_diff_sampling_param reads
        generation_config = "auto"
        override_generation_config: dict = {}

        def try_get_generation_config(self):
            return dict(gen)

    want = VllmModelConfig.get_diff_sampling_param(_Cfg())
    assert {**mt.generation_defaults, "max_tokens": mt.default_max_tokens} == want


def test_load_model_text_without_tokenizer_json_fails_loudly(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_model_text(tmp_path)


# ------------------------------------------------------------------------------------------------------------
# Against vLLM's own detokenizer (FastIncrementalDetokenizer + its stop-string rules), on a corpus, in the dev
# venv: same final text, token ids and stop reason for every case, fed one token at a time and in batches.
# ------------------------------------------------------------------------------------------------------------

_TEXTS = ["hello world, hello router", "naïve café — 東京 🦙 ok", "  leading spaces and\ttabs\nnew lines",
          "🦙🦙 multi-byte only", "stop here STOP now and more", "once upon a time there was a tiny llama",
          "数字 123 and ünïcödé ✓✓", "a" * 40]


def _sentencepiece_tokenizer():
    """Llama-2 style: Metaspace + byte fallback (bytes as <0xNN> tokens), a decoder that strips one space."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(_TEXTS * 3 + ["the quick brown fox jumps over the lazy dog"] * 5, trainer)
    return tok


def _tiny_model_tokenizer(tmp):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "scripts" / "make_tiny_model.py"
    spec = importlib.util.spec_from_file_location("make_tiny_model_for_detok", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.train_tokenizer(mod.DEFAULT_CORPUS)


def _save(tok, d, eos: str) -> None:
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, clean_up_tokenization_spaces=False).save_pretrained(
        str(d))


def _vllm_final(vtok, prompt, ids, *, chunks, stop=(), stop_ids=(), eos=None, max_tokens=64, min_tokens=0,
                include_stop=False):
    """vLLM 0.32: the engine core's stop checks (EOS/stop ids past min_tokens, max_tokens), then the frontend
    detokenizer's update() per engine step (its stop strings), then the finished text."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer, IncrementalDetokenizer as VDetok

    sp = SamplingParams(max_tokens=max_tokens, stop=list(stop) or None, stop_token_ids=list(stop_ids),
                        min_tokens=min_tokens, include_stop_str_in_output=include_stop)
    req = EngineCoreRequest("r", list(prompt), None, sp, None, 0.0, None, None, None)
    d = VDetok.from_new_request(vtok, req)
    assert isinstance(d, FastIncrementalDetokenizer)  # vLLM's fast path, the one we mirror
    reason = "length"
    stop_reason = None
    n = 0
    for chunk in chunks(ids):
        step, terminated = [], False
        for t in chunk:
            step.append(t)
            n += 1
            if n > min_tokens and (t == eos or t in stop_ids):
                terminated, reason, stop_reason = True, "stop", (None if t == eos and t not in stop_ids else t)
                break
            if n >= max_tokens:
                break
        s = d.update(step, terminated)
        if s is not None:
            return d.get_next_output_text(True, False), list(d.output_token_ids), "stop", s
        if terminated or n >= max_tokens:
            return d.get_next_output_text(True, False), list(d.output_token_ids), reason, stop_reason
    return d.get_next_output_text(True, False), list(d.output_token_ids), reason, stop_reason


def _ours_final(tok, prompt, ids, *, chunks, stop=(), stop_ids=(), eos=None, max_tokens=64, min_tokens=0,
                include_stop=False):
    asm = OutputAssembler(IncrementalDetokenizer(tok, list(prompt)), max_tokens=max_tokens, stop=stop,
                          stop_token_ids=stop_ids, eos_token_ids=[eos] if eos is not None else [],
                          min_tokens=min_tokens, include_stop_str_in_output=include_stop)
    text = ""
    for chunk in chunks(ids):
        text += asm.push(chunk)
        if asm.finished:
            break
    text += asm.finish("length")
    assert text == asm.text  # what was streamed is the final text
    return text, asm.token_ids, asm.finish_reason, asm.stop_reason


def _one(ids):
    return [[t] for t in ids]


def _threes(ids):
    return [ids[i:i + 3] for i in range(0, len(ids), 3)]


@pytest.fixture(scope="module", params=["tiny-model", "byte-level", "sentencepiece-byte-fallback"])
def both_tokenizers(request, tokenizer, tmp_path_factory):
    pytest.importorskip("vllm")
    from vllm.tokenizers import get_tokenizer

    if request.param == "tiny-model":
        tok, eos = _tiny_model_tokenizer(tmp_path_factory), "<|end_of_text|>"  # make_tiny_model.EOS
    elif request.param == "byte-level":
        tok, eos = tokenizer, "<|eos|>"
    else:
        tok, eos = _sentencepiece_tokenizer(), "</s>"
    d = tmp_path_factory.mktemp(request.param)
    _save(tok, d, eos)
    return tok, get_tokenizer(str(d)), tok.token_to_id(eos)


def _corpus(tok, eos_id):
    import random

    rng = random.Random(0)
    vocab = tok.get_vocab_size()
    cases = []
    for text in _TEXTS:
        ids = tok.encode(text, add_special_tokens=False).ids
        cases.append((tok.encode("prompt: " + text[:5], add_special_tokens=False).ids, ids, {}))
    for text in _TEXTS[:4]:  # EOS mid-stream; a stop id; min_tokens past an EOS
        ids = tok.encode(text, add_special_tokens=False).ids
        cases.append(([], ids[:3] + [eos_id] + ids[3:], {}))
        cases.append(([], ids, {"stop_ids": (ids[len(ids) // 2],)}))
        cases.append(([], [eos_id] + ids + [eos_id], {"min_tokens": 2}))
    for stop, include in ((("STOP",), False), (("STOP",), True), (("llama", "time"), False), (("o",), False),
                          (("🦙",), False), (("café",), True)):
        for text in _TEXTS:
            cases.append(([], tok.encode(text, add_special_tokens=False).ids, {"stop": stop, "include_stop": include}))
    for n in (3, 10):  # max_tokens cuts
        cases.append(([], tok.encode(_TEXTS[1], add_special_tokens=False).ids, {"max_tokens": n}))
    for _ in range(40):  # random ids: odd byte runs, invalid UTF-8, special tokens in the middle
        cases.append(([rng.randrange(vocab) for _ in range(rng.randrange(0, 12))],
                      [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))], {}))
    return cases


@pytest.mark.parametrize("chunks", [_one, _threes], ids=["one-by-one", "batches-of-3"])
def test_final_text_equals_vllms_detokenizer_on_a_corpus(both_tokenizers, chunks):
    tok, vtok, eos_id = both_tokenizers
    cases = _corpus(tok, eos_id)
    mismatches = []
    for prompt, ids, kw in cases:
        ours = _ours_final(tok, prompt, ids, chunks=chunks, eos=eos_id, **kw)
        theirs = _vllm_final(vtok, prompt, ids, chunks=chunks, eos=eos_id, **kw)
        if ours != theirs:
            mismatches.append((prompt, ids, kw, ours, theirs))
    assert not mismatches, f"{len(mismatches)} of {len(cases)} differ, first: {mismatches[0]}"


def test_print_per_token_cost(both_tokenizers, capsys):
    """A benchmark that prints (no timing assertion): per-token cost of push() now (DecodeStream) and of the
    prefix/read-offset window scheme it replaced (two decode() calls of a small window per token)."""
    import time

    tok, _, _ = both_tokenizers
    ids = tok.encode(" ".join(_TEXTS) * 8, add_special_tokens=False).ids
    prompt = ids[:200]

    class WindowScheme:  # the replaced implementation, kept here only to measure it
        def __init__(self, prompt):
            self.tokens, self.prefix = list(prompt[-8:]), 0
            self.read = len(self.tokens)

        def push(self, t):
            self.tokens.append(t)
            a = tok.decode(self.tokens[self.prefix:self.read])
            b = tok.decode(self.tokens[self.prefix:])
            if len(b) > len(a) and not b.endswith("\ufffd"):
                self.prefix, self.read = self.read, len(self.tokens)
                return b[len(a):]
            return ""

    def per_token_us(make) -> float:
        best = float("inf")
        for _ in range(5):
            d = make()
            t0 = time.perf_counter()
            for t in ids:
                d.push(t)
            best = min(best, (time.perf_counter() - t0) / len(ids) * 1e6)
        return best

    new = per_token_us(lambda: IncrementalDetokenizer(tok, prompt))
    old = per_token_us(lambda: WindowScheme(prompt))
    with capsys.disabled():
        print(f"\n  detokenizer per token ({len(ids)} tokens, best of 5): DecodeStream {new:.2f} us, "
              f"window scheme {old:.2f} us")
