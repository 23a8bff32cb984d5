"""Fixtures for the engine tests: random checkpoints of each supported architecture."""

from __future__ import annotations

import pytest
import torch

from ._models import KINDS, build_model

torch.set_num_threads(1)  # the CI machine has 2 shared cores


@pytest.fixture(scope="session", params=sorted(KINDS))
def hf_model(request, tmp_path_factory):
    kind = request.param
    out = tmp_path_factory.mktemp(f"model-{kind}")
    return kind, out, build_model(out, kind)
