"""A forward's inputs given as host token ids are staged (StepRunner._stage: on a GPU one copy from a pinned slot)
and a verify's argmaxes come back through its graph (StepRunner.greedy_rows): the same logits, the same targets
and the same count of greedy steps as the device's own, in every step mode here (eager on the CPU; the lean
graph, the PyTorch graph and the compiled graph on a GPU), with more forwards queued than there are pinned
slots."""

from __future__ import annotations

import pytest
import torch

from expresslane.engine.decode import DecodeEngine, SamplingParams

from .test_engine_vs_transformers import PROMPT

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="needs a CUDA device"))]
# (cuda_graph, compile, lean): the CUDA step modes; the CPU runs eager.
MODES = {"cpu": [(False, False, False)],
         "cuda": [(True, False, None), (True, False, False), (True, True, False), (False, False, False)]}


def engines(path, device):
    for cuda_graph, compile, lean in MODES[device]:
        e = DecodeEngine.from_pretrained(path, dtype="float32", device=device, max_seq_len=128,
                                         cuda_graph=cuda_graph, compile=compile)
        if lean is not None:
            e.runner.set_lean(lean)
        e.prefill(PROMPT)
        yield f"{e.runner.mode.value}", e


@pytest.mark.parametrize("device", DEVICES)
def test_staged_rows_are_the_device_tensors_forward(hf_model, device):
    _, path, _ = hf_model
    for mode, e in engines(path, device):
        runner, pos = e.runner, len(PROMPT)
        assert runner.max_rows > 2, "speculation is off: no verify rows to stage"
        # More forwards than pinned slots, queued back to back, each a different set of rows at the same start
        # (each writes its own rows' K/V; what it reads before them is the prompt's), each's logits copied in
        # stream order; then the same forwards from device tensors, one at a time.
        batches = [[(7 * i + j) % e.vocab_size for j in range(1 + i % runner.max_rows)]
                   for i in range(3 * runner.STAGING_SLOTS)]
        staged = [runner.forward(rows, pos).clone() for rows in batches]
        for rows, got in zip(batches, staged):
            want = runner.forward(torch.tensor(rows, device=e.device), pos).clone()
            assert torch.equal(got, want), (mode, rows)
            targets = runner.greedy_rows(rows, pos)
            assert targets == want.argmax(dim=-1).tolist(), (mode, rows)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the lean step's ring)")
def test_the_hosts_greedy_count_is_the_devices(hf_model):
    """The greedy chain reads the lean step's ring by the step count the host keeps (no read of the device):
    it must stay the device's greedy_seq across requests, a capture and a lean step built again."""
    kind, path, _ = hf_model
    for mode, e in engines(path, "cuda"):
        for round_ in range(2):
            for lookup in (PROMPT, PROMPT * 2):  # plain steps only, then verifies among them
                first = int(e.prefill(PROMPT).argmax())
                got = list(e.generate(first, len(PROMPT), SamplingParams(max_tokens=20, ignore_eos=True,
                                                                         prompt_token_ids=lookup)))
                assert len(got) == 20
            lean = e.runner._lean
            assert lean is not None or mode != "lean-graph"
            if lean is not None:
                assert e.runner._greedy_steps == int(lean.greedy_seq[0]) > 0, mode
            if round_ == 0 and lean is not None:  # a new lean step counts from 0 again
                e.runner.set_lean(False)
                e.runner.set_lean(None)
                assert e.runner._greedy_steps == 0
