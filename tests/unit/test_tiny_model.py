"""scripts/make_tiny_model.py: a deterministic tiny Llama that transformers loads and that is fit for exactness tests.

vLLM serving it (token-identical to transformers under greedy) was checked by hand; these tests stay fast.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "make_tiny_model.py"

PROMPTS = [
    "The harbor was quiet before dawn",
    "def fibonacci(n):\n",
    "Question: Why is the sky blue?\nAnswer:",
    "SELECT customer_id, COUNT(*) FROM",
]
NEW_TOKENS = 32
# Measured (seed 0, float32, these prompts): mean top1-top2 logit gap ~9.7 over greedy steps; distinct tokens per
# 32-token generation 27-32. A stock 0.02-scale random init gives gaps around 0.01, so these can fail.
MIN_MEAN_MARGIN = 5.0
MIN_DISTINCT = 16


def _load_script():
    spec = importlib.util.spec_from_file_location("make_tiny_model", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, env=env
    )


@pytest.fixture(scope="module")
def mtm():
    return _load_script()


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model does not need more; the machine is shared
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir(mtm, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "fp32"
    mtm.generate(out, seed=0, dtype="float32")
    return out


@pytest.fixture(scope="module")
def tok(model_dir):
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def greedy(model, tok):
    """prompt -> (generated ids, per-step top1-top2 margins, per-step top logit minus EOS logit)."""
    results = {}
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=tok.pad_token_id,
            )
        gen = out.sequences[0, ids.shape[1] :].tolist()
        margins, eos_gaps = [], []
        for scores in out.scores:
            top2 = scores[0].topk(2).values
            margins.append(float(top2[0] - top2[1]))
            eos_gaps.append(float(top2[0] - scores[0, tok.eos_token_id]))
        results[prompt] = (gen, margins, eos_gaps)
    return results


def test_config_fields(model_dir):
    cfg = transformers.AutoConfig.from_pretrained(str(model_dir))
    raw = json.loads((model_dir / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLM"]
    assert cfg.model_type == "llama"
    assert cfg.max_position_embeddings >= 4096
    assert cfg.vocab_size == 1024
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 256, 8, 4)
    assert cfg.head_dim == 32
    assert cfg.tie_word_embeddings is False
    assert raw["rope_theta"] == 10000.0 and raw["rms_norm_eps"] == 1e-5
    assert raw["torch_dtype"] == "float32"
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (cfg.bos_token_id, cfg.eos_token_id)
    marker = json.loads((model_dir / "expresslane_tiny_model.json").read_text())
    assert (marker["seed"], marker["dtype"]) == (0, "float32")
    assert marker["files_sha256"]["model.safetensors"] == _sha(model_dir / "model.safetensors")


def test_tokenizer_vocab_and_specials(tok, model_dir):
    assert len(tok) == 1024
    vocab = tok.get_vocab()
    for name in ("<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"):
        assert name in vocab
    assert tok.bos_token == "<|begin_of_text|>" and tok.eos_token == "<|end_of_text|>"
    assert tok.bos_token_id != tok.eos_token_id
    assert tok("hello").input_ids[0] == tok.bos_token_id
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert cfg["bos_token"] == tok.bos_token and cfg["eos_token"] == tok.eos_token
    assert "chat_template" in cfg


@pytest.mark.parametrize(
    "text",
    [
        "plain ascii, with  double  spaces , and punctuation !",
        "  leading and trailing whitespace\t\n",
        "Ünïcödé: naïve café, Straße,日本語のテキスト, 한국어, العربية, עברית",
        "emoji 🚀🧪👩‍💻 and combining e\u0301 and zero\u200bwidth",
        "control \x00\x01\x7f and a lone surrogate-free 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 line\r\n",
        "<|im_start|> looks special only as a real token",
    ],
)
def test_tokenizer_round_trips_any_text(tok, text):
    ids = tok(text, add_special_tokens=False).input_ids
    assert all(0 <= i < 1024 for i in ids)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_chat_template_renders(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    no_gen = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert no_gen == text[: -len("<|im_start|>assistant\n")]
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3


def test_greedy_not_degenerate(greedy, tok):
    outputs = []
    for prompt, (gen, _, _) in greedy.items():
        assert len(gen) == NEW_TOKENS, f"{prompt!r} stopped early: {gen}"
        assert len(set(gen)) >= MIN_DISTINCT, f"{prompt!r} degenerate: {gen}"
        longest_run = max(sum(1 for _ in g) for _, g in itertools.groupby(gen))
        assert longest_run <= 3, f"{prompt!r} repeats a token: {gen}"
        text = tok.decode(gen)
        assert "\ufffd" not in text  # every greedy token is whole UTF-8
        outputs.append(tuple(gen))
    assert len(set(outputs)) == len(outputs)
    assert len({o[0] for o in outputs}) >= len(outputs) - 1  # first tokens vary across prompts


def test_logit_margin_large(greedy):
    margins = [m for _, ms, _ in greedy.values() for m in ms]
    mean = sum(margins) / len(margins)
    assert mean >= MIN_MEAN_MARGIN, f"mean top1-top2 margin {mean:.3f}"
    # Float32 engines differ by ~1e-4 in these logits; nearly every step must clear that by far.
    assert sum(m < 0.01 for m in margins) <= 1, sorted(margins)[:5]


def test_eos_and_specials_never_greedy(greedy, tok, model):
    special_ids = set(tok.all_special_ids) | {tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")}
    for gen, _, eos_gaps in greedy.values():
        assert not special_ids & set(gen)
        assert min(eos_gaps) > 10.0
    head = model.lm_head.weight.detach()
    assert float(head[tok.eos_token_id].abs().max()) == 0.0


def test_output_depends_on_context(model, tok):
    # Same last token, different history: a model that ignores the KV cache would continue identically.
    outs = []
    for prompt in ("The harbor was quiet and", "Rows of green lamps and"):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
        outs.append(out[0, ids.shape[1] :].tolist())
    assert tok("x and").input_ids[-1] == tok("y and").input_ids[-1]
    assert outs[0] != outs[1]


def test_deterministic_cli_and_cache(mtm, model_dir, tmp_path, capsys):
    # A second run, in a fresh process through the CLI, is byte-identical to the fixture's in-process run.
    out = tmp_path / "again"
    r = _run_cli(str(out))
    assert r.returncode == 0, r.stderr
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert _sha(out / name) == _sha(model_dir / name), name
    # Up to date: exit 0 without rewriting.
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    assert mtm.main([str(out)]) == 0
    assert "up to date" in capsys.readouterr().out
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime
    # A different seed is a mismatch: rebuilt, with different weights but the same tokenizer.
    assert mtm.main([str(out), "--seed", "1"]) == 0
    assert _sha(out / "model.safetensors") != _sha(model_dir / "model.safetensors")
    assert _sha(out / "tokenizer.json") == _sha(model_dir / "tokenizer.json")
    assert json.loads((out / "expresslane_tiny_model.json").read_text())["seed"] == 1
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temp leftovers


def test_refuses_foreign_dir_without_force(mtm, tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text("{}")
    assert mtm.main([str(foreign)]) == 2
    assert (foreign / "config.json").read_text() == "{}"
    assert mtm.main([str(foreign), "--force"]) == 0
    assert json.loads((foreign / "config.json").read_text())["vocab_size"] == 1024


def test_bfloat16_loads_and_generates(mtm, model_dir, tmp_path, tok):
    out = tmp_path / "bf16"
    mtm.generate(out, seed=0, dtype="bfloat16")
    raw = json.loads((out / "config.json").read_text())
    assert raw["torch_dtype"] == "bfloat16"
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16
    assert _sha(out / "tokenizer.json") == _sha(model_dir / "tokenizer.json")
    m = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype="auto").eval()
    assert m.lm_head.weight.dtype == torch.bfloat16
    ids = tok(PROMPTS[0], return_tensors="pt").input_ids
    with torch.no_grad():
        gen = m.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id)[0, ids.shape[1] :]
    assert len(gen) == 16 and len(set(gen.tolist())) >= 8
