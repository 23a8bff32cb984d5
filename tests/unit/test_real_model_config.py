"""Any checkpoint by its own name: the aliases derive from the served model's name, your own checkpoint directory is
served as it is, and a checkpoint the express engine cannot serve is refused at start with a line naming what.

Fast: no server starts (the express launcher's check runs alone, before its server would).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import dev_stack
import gpu_stack
from dev_stack import DevStack, StackError

REPO = Path(__file__).resolve().parents[2]
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
         "rms_norm_eps": 1e-5, "max_position_embeddings": 128, "hidden_act": "silu", "tie_word_embeddings": True}


def _safetensors(path: Path, dtypes: dict[str, str]) -> None:
    """A safetensors file whose header names one 2-element tensor per (name, dtype); the data is zeros."""
    size = {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "I8": 1, "U8": 1}
    header, offset = {}, 0
    for name, dtype in dtypes.items():
        n = 2 * size[dtype]
        header[name] = {"dtype": dtype, "shape": [2], "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


def _checkpoint(tmp_path: Path, name: str = "my-model", config: dict | None = None,
                dtypes: dict[str, str] | None = None) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config or LLAMA))
    (d / "tokenizer.json").write_text("{}")
    _safetensors(d / "model.safetensors", dtypes or {"model.embed_tokens.weight": "F32"})
    return d


def _check(model_dir: Path, capsys) -> subprocess.CompletedProcess:
    """What scripts/launch/decode-express.sh runs before its server (main([DIR]), in this process)."""
    from expresslane.engine.models.config import main

    rc = main([str(model_dir)])
    out = capsys.readouterr()
    return subprocess.CompletedProcess([], rc, out.out, out.err)


# ---- the served name and the aliases --------------------------------------------------------------------------


def test_the_dev_stack_serves_a_directory_under_its_own_name(tmp_path, monkeypatch):
    monkeypatch.delenv("SERVED_MODEL_NAME", raising=False)
    own = _checkpoint(tmp_path, "Qwen2.5-0.5B-Instruct")
    stack = DevStack(model_dir=own, state_dir=tmp_path / "s")
    assert stack.model is None  # not a model model_init.py writes: served as it is
    assert stack.aliases == ("Qwen2.5-0.5B-Instruct", "Qwen2.5-0.5B-Instruct-express")
    env = stack.env()
    assert (env["MODEL_DIR"], env["SERVED_MODEL_NAME"]) == (str(own), "Qwen2.5-0.5B-Instruct")
    stack.ensure_model()  # a checkpoint directory: nothing to write, no error
    named = DevStack(model_dir=own, state_dir=tmp_path / "s", served_model_name="mine")
    assert named.aliases == ("mine", "mine-express") and named.env()["SERVED_MODEL_NAME"] == "mine"
    assert DevStack(state_dir=tmp_path / "t").model == "tiny-llama"  # the tests' default stays the tiny model
    real = DevStack(model_dir=tmp_path / "smollm2-135m-instruct", state_dir=tmp_path / "u")
    assert real.model == "smollm2-135m-instruct" and real.aliases[1] == "smollm2-135m-instruct-express"


def test_the_router_config_derives_the_aliases_from_the_dev_stacks_name(tmp_path, monkeypatch):
    from expresslane.router.config import load_config

    monkeypatch.delenv("SERVED_MODEL_NAME", raising=False)
    env = DevStack(model_dir=_checkpoint(tmp_path, "llama-3.2-1b"), state_dir=tmp_path / "s").env()
    cfg = load_config(REPO / "compose" / "config" / "router.yaml", env)
    assert cfg.prefill.model == "llama-3.2-1b"
    assert {a: cfg.aliases[a].pool for a in cfg.aliases} == {"llama-3.2-1b": "native",
                                                            "llama-3.2-1b-express": "express"}


def test_a_directory_that_is_no_checkpoint_is_refused_before_anything_starts(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(StackError, match="not a checkpoint directory"):
        DevStack(model_dir=empty, state_dir=tmp_path / "s").ensure_model()


def test_the_cli_serves_the_real_model_by_default_and_an_own_directory_as_it_is(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(DevStack, "start", lambda self: seen.setdefault("stack", self))
    monkeypatch.setattr(DevStack, "status", lambda self: {})
    assert dev_stack.main(["up", "--state-dir", str(tmp_path / "a")]) == 0
    assert seen.pop("stack").model_dir == dev_stack.MODELS_DIR / "smollm2-135m-instruct"
    own = _checkpoint(tmp_path, "mine")
    assert dev_stack.main(["up", "--state-dir", str(tmp_path / "b"), "--model-dir", str(own)]) == 0
    stack = seen.pop("stack")
    assert (stack.model, stack.model_dir, stack.aliases[0]) == (None, own.resolve(), "mine")


def test_the_launchers_default_the_served_name_to_the_directory(tmp_path):
    common = REPO / "scripts" / "launch" / "common.sh"
    env = {k: v for k, v in os.environ.items() if k not in ("SERVED_MODEL_NAME", "MODEL_DIR")}
    out = subprocess.run(["bash", "-c", f'source "{common}"; echo "$MODEL_DIR $SERVED_MODEL_NAME"'],
                         env=dict(env, MODEL_DIR="/srv/models/Qwen3-8B"), capture_output=True, text=True)
    assert out.stdout.split() == ["/srv/models/Qwen3-8B", "Qwen3-8B"]
    out = subprocess.run(["bash", "-c", f'source "{common}"; echo "$MODEL_DIR $SERVED_MODEL_NAME"'],
                         env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["/models/smollm2-135m-instruct", "smollm2-135m-instruct"]


# ---- a checkpoint the express engine cannot serve ----------------------------------------------------------------


@pytest.mark.parametrize("change,needle", [
    (dict(model_type="mistral", architectures=["MistralForCausalLM"]), "model_type='mistral'"),
    (dict(architectures=["LlamaForSequenceClassification"]), "LlamaForSequenceClassification"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope type 'yarn'"),
    (dict(quantization_config={"quant_method": "fp8"}), "quant_method='fp8'"),
])
def test_an_unsupported_config_is_named_at_start(tmp_path, capsys, change, needle):
    proc = _check(_checkpoint(tmp_path, config={**LLAMA, **change}), capsys)
    assert proc.returncode == 2 and "unsupported checkpoint" in proc.stderr and needle in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("dtype", ["F8_E4M3", "I8"])
def test_unsupported_tensor_dtypes_are_named_at_start(tmp_path, capsys, dtype):
    d = _checkpoint(tmp_path, dtypes={"model.embed_tokens.weight": "BF16", "model.layers.0.mlp.down_proj.weight": dtype})
    proc = _check(d, capsys)
    assert proc.returncode == 2 and f"['{dtype}']" in proc.stderr and "down_proj" in proc.stderr, proc.stderr


def test_a_pytorch_bin_checkpoint_is_named_at_start(tmp_path, capsys):
    d = tmp_path / "bin"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA))
    (d / "pytorch_model.bin").write_bytes(b"\0")
    proc = _check(d, capsys)
    assert proc.returncode == 2 and "pytorch_model.bin" in proc.stderr and ".bin checkpoints are not supported" in \
        proc.stderr, proc.stderr


def test_a_supported_checkpoint_passes_and_the_launcher_stops_on_a_bad_one(tmp_path, capsys):
    good = _check(_checkpoint(tmp_path, "good", dtypes={"model.embed_tokens.weight": "BF16"}), capsys)
    assert good.returncode == 0 and "supported" in good.stdout, good.stderr
    bad = _checkpoint(tmp_path, "bad", config={**LLAMA, "hidden_act": "relu"})
    env = dict(os.environ, PYTHON=sys.executable, MODEL_DIR=str(bad))
    proc = subprocess.run(["bash", str(REPO / "scripts" / "launch" / "decode-express.sh")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "hidden_act='relu'" in proc.stderr and "Traceback" not in proc.stderr


def test_the_loader_refuses_before_reading_a_tensor(tmp_path):
    from expresslane.engine.models.config import ModelConfig, UnsupportedModelError
    from expresslane.engine.models.loader import load_model

    torch = pytest.importorskip("torch")
    d = _checkpoint(tmp_path, dtypes={"model.embed_tokens.weight": "F8_E4M3"})
    with pytest.raises(UnsupportedModelError, match="F8_E4M3"):
        load_model(d, ModelConfig.from_model_dir(d), torch.float32, "cpu")


# ---- the GPU stack's native-lane transport -------------------------------------------------------------------------


def test_the_gpu_stacks_native_lane_reads_over_cuda_ipc_by_default(tmp_path):
    args = gpu_stack.parse_args(["--shapes", "llama-8b", "--models", str(tmp_path), "--out", "x"])
    env = gpu_stack.stack_env("llama-8b", args)
    assert env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "on" and env["UCX_TLS"].startswith("cuda_ipc,cuda_copy")
    old = gpu_stack.stack_env("llama-8b", gpu_stack.parse_args(["--shapes", "llama-8b", "--models", str(tmp_path),
                                                                "--out", "x", "--native-transport", "ucx-default"]))
    assert not any(k.startswith("UCX_") for k in old)
    tls = gpu_stack.stack_env("llama-8b", gpu_stack.parse_args(["--shapes", "llama-8b", "--models", str(tmp_path),
                                                                "--out", "x", "--ucx-tls", "cuda_ipc,tcp"]))
    assert tls["UCX_TLS"] == "cuda_ipc,tcp" and tls["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "on"


# ---- the one-host CPU split, as a launcher value ----------------------------------------------------------------------


@pytest.mark.parametrize("cpus,first,second,threads", [("0", "0", "0", "1"), ("0,1", "0", "1", "1"),
                                                        ("0-3", "0,1", "2,3", "2"), ("0-2", "0", "1,2", "2")])
def test_split_gives_prefill_and_native_decode_disjoint_halves(cpus, first, second, threads):
    """PREFILL_CPU_BIND=split / DECODE_NATIVE_CPU_BIND=split / EXPRESS_THREADS=split: dev_stack.py's cpu_split, for
    compose (every container sees the host's CPUs); other values pass through to vLLM unchanged."""
    if not set(range(int(cpus[-1]) + 1)) <= os.sched_getaffinity(0):
        pytest.skip(f"this host has fewer CPUs than {cpus}")
    launch = REPO / "scripts" / "launch"
    script = (f'source "{launch}/common.sh"; echo "$(cpu_bind split first) $(cpu_bind split second) '
              f'$(cpu_bind 0-7 first) $(cpu_bind auto second)"')
    out = subprocess.run(["taskset", "-c", cpus, "bash", "-c", script], env=dict(os.environ, PYTHON=sys.executable),
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == [first, second, "0-7", "auto"], out.stderr
    threads_of = subprocess.run(
        ["taskset", "-c", cpus, "bash", "-c", f'source "{launch}/common.sh"; '
         'echo "$(cpu_bind split second | tr "," "\\n" | wc -l)"'],
        env=dict(os.environ, PYTHON=sys.executable), capture_output=True, text=True, timeout=60)
    assert threads_of.stdout.strip() == threads
