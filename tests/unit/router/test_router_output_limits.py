"""vLLM 0.32's output-length limits on the express lane (output_limits.py): the same status, body and words as
vLLM's own validation (compared with vLLM's code in the dev venv), checked before any work where the prompt length
is not needed, else right after the prefill reply with the node's reservation cancelled."""

from __future__ import annotations

import pytest

from expresslane.router.errors import VllmValidation
from expresslane.router.openai.output_limits import check_requested, effective_max_tokens
from expresslane.router.openai.request import options_of

from ._kit import EXPRESS, PREFILL
from .test_router_express_lane import PROMPT_IDS, FakeNode

L = 64  # the kit's max_model_len
CHAT = {"model": "tiny-x", "messages": [{"role": "user", "content": "hi"}]}
COMP = {"model": "tiny-x", "prompt": "hi"}


def _vllm_error(fn) -> dict:
    pytest.importorskip("vllm", reason="vLLM is not installed (the reference)")
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return create_error_response(e).model_dump()
    raise AssertionError("vLLM accepted it")


@pytest.mark.parametrize("body,chat,param", [
    ({"max_tokens": 1_000_000_000}, False, "max_tokens"),
    ({"max_tokens": L + 1}, True, "max_tokens"),
    ({"max_completion_tokens": 100, "max_tokens": 5}, True, "max_completion_tokens"),
])
def test_requested_over_the_context_is_vllms_400(body, chat, param):
    from vllm.renderers import TokenizeParams

    n = body.get("max_completion_tokens", body.get("max_tokens"))
    want = _vllm_error(lambda: TokenizeParams(max_total_tokens=L, max_output_tokens=n, max_total_tokens_param=
                                              "max_model_len", max_output_tokens_param=param))
    with pytest.raises(VllmValidation) as e:
        check_requested(options_of(body, chat), L)
    assert e.value.status == 400 and e.value.body() == want


def test_min_tokens_over_the_effective_budget_is_vllms_400():
    from vllm.sampling_params import SamplingParams

    want = _vllm_error(lambda: SamplingParams(max_tokens=L - 60, min_tokens=10))
    with pytest.raises(VllmValidation) as e:
        effective_max_tokens(options_of({"max_tokens": 30, "min_tokens": 10}, False), L, 60)  # budget clamps to 4
    assert e.value.body() == want


def test_effective_budget_is_vllms_get_max_tokens():
    pytest.importorskip("vllm", reason="vLLM is not installed (the reference)")
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens

    for body, chat in [({}, False), ({"max_tokens": None}, False), ({"max_tokens": 10}, False), ({}, True),
                       ({"max_tokens": 60}, True), ({"max_completion_tokens": 3, "max_tokens": 50}, True)]:
        for n_prompt in (1, 6, 63):
            req = body.get("max_completion_tokens", body.get("max_tokens", None if chat else 16))
            assert effective_max_tokens(options_of(body, chat), L, n_prompt) == get_max_tokens(L, req, n_prompt, {}), (body, n_prompt)
            for default in (5, 1000):  # a generation_config max_new_tokens: vLLM's default_sampling_params
                assert (effective_max_tokens(options_of(body, chat), L, n_prompt, default)
                        == get_max_tokens(L, req, n_prompt, {"max_tokens": default})), (body, n_prompt, default)


@pytest.fixture
def node(upstreams, tokenizer):
    return FakeNode(upstreams, tokenizer)


async def test_max_tokens_over_the_context_costs_no_work(make_client, node, upstreams):
    async with make_client() as (c, _):
        r = await c.post("/v1/completions", json=dict(COMP, max_tokens=1_000_000_000))
    assert r.status_code == 400
    assert r.json()["error"] == {"message": "max_tokens=1000000000 cannot be greater than max_model_len=64. Please "
                                            "request fewer output tokens. (parameter=max_tokens, value=1000000000)",
                                 "type": "BadRequestError", "param": "max_tokens", "code": 400}
    assert [p for (_, p, _) in upstreams.calls if p != "/capabilities"] == []


async def test_min_tokens_over_the_budget_cancels_the_reservation(make_client, node, upstreams):
    async with make_client() as (c, _):
        r = await c.post("/v1/chat/completions", json=dict(CHAT, max_tokens=L, min_tokens=60))
    assert r.status_code == 400
    eff = L - len(PROMPT_IDS)
    assert r.json()["error"]["message"] == f"min_tokens must be less than or equal to max_tokens={eff}, got 60."
    assert upstreams.bodies(EXPRESS, "/pd/decode") == []
    assert node.reserved and node.cancelled == node.reserved  # the node's reservation went back at once
    assert len(upstreams.bodies(PREFILL, "/v1/chat/completions")) == 1


async def test_a_budget_past_the_prompt_is_clamped_as_vllm_does(make_client, node, upstreams):
    async with make_client() as (c, _):
        r = await c.post("/v1/completions", json=dict(COMP, max_tokens=L))
    assert r.status_code == 200
    (dec,) = upstreams.bodies(EXPRESS, "/pd/decode")
    assert dec["max_tokens"] == L - len(PROMPT_IDS)
