"""Client API keys (auth.py): several keys from RouterSecrets, constant-time match over all keys, per-key lanes and
rate limits, OpenAI-shaped 401/403/429, keys never in errors, reprs or logs."""

from __future__ import annotations

import logging

import pytest

from expresslane.router.server import auth as auth_mod
from expresslane.router.server.auth import ApiKeys, AuthConfigError, TokenBucket, parse_api_keys
from expresslane.router.server.secrets import RouterSecrets

from ._kit import make_config
from .test_router_native_lane import CLIENT, vllm  # noqa: F401  (fake prefill + native decode)

ALICE = "sk-alice-0123456789abcdef"
BOB = "sk-bob-fedcba9876543210"
KEYS = f"""
# comment line
{ALICE}
{BOB}   name=bob lanes=native rps=1   # bob: native only, one request per second
"""


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_parse_fields_comments_and_defaults():
    alice, bob = parse_api_keys(KEYS)
    assert (alice.name, alice.lanes, alice.rps) == ("key3", frozenset({"native", "express"}), None)
    assert (bob.name, bob.lanes, bob.rps, bob.burst) == ("bob", frozenset({"native"}), 1.0, 1.0)
    (ci,) = parse_api_keys("sk-ci-000000000 name=ci rps=0.5 burst=3")
    assert (ci.rps, ci.burst) == (0.5, 3.0)
    assert ALICE not in repr(parse_api_keys(KEYS)) and BOB not in repr(ApiKeys(parse_api_keys(KEYS)))


@pytest.mark.parametrize("text,needle", [
    ("sk-xxxxxxxxxxxx color=red", "unknown field 'color'"),
    ("sk-xxxxxxxxxxxx lanes=fast", "lanes= must be"),
    ("sk-xxxxxxxxxxxx rps=0", "rps= must be a number > 0"),
    ("sk-xxxxxxxxxxxx rps=nan", "rps= must be a number > 0"),
    ("sk-xxxxxxxxxxxx burst=2", "burst= needs rps="),
    ("sk-xxxxxxxxxxxx rps=1 burst=0.5", "burst= must be"),
    ("sk-xxxxxxxxxxxx name=a\nsk-yyyyyyyyyyyy name=a", "two keys are named 'a'"),
    ("sk-xxxxxxxxxxxx name=a\nsk-xxxxxxxxxxxx name=b", "are the same key"),
    ("k3y-7ch", "shorter than 8"),
])
def test_bad_key_lines_name_the_line_never_the_key(text, needle):
    with pytest.raises(AuthConfigError) as e:
        parse_api_keys(text)
    assert needle in str(e.value)
    for word in text.split():
        if word.startswith(("sk-", "k3y")):
            assert word not in str(e.value)


def test_match_compares_every_key_whichever_matches(monkeypatch):
    keys = ApiKeys(parse_api_keys("\n".join(f"sk-key-number-{i:04d}" for i in range(7))))
    calls = []
    real = auth_mod.hmac.compare_digest
    monkeypatch.setattr(auth_mod.hmac, "compare_digest", lambda a, b: calls.append(len(a)) or real(a, b))
    for token in ("sk-key-number-0000", "sk-key-number-0006", "nope", "x" * 5000):
        calls.clear()
        found = keys.match(token)
        assert len(calls) == 7 and set(calls) == {32}  # all keys, always equal-length digests
        assert (found is not None) == token.startswith("sk-key")


def test_token_bucket_refills_at_its_rate():
    clock = Clock()
    b = TokenBucket(2.0, 2.0, clock)
    assert b.take() == 0.0 and b.take() == 0.0
    assert b.take() == pytest.approx(0.5)
    clock.t += 0.5
    assert b.take() == 0.0 and b.take() > 0


def test_legacy_single_key_joins_the_list(tmp_path):
    f = tmp_path / "keys"
    f.write_text(f"{BOB} name=bob\n")
    s = RouterSecrets.from_env({"ROUTER_API_KEYS_FILE": str(f), "ROUTER_API_KEY": ALICE})
    assert sorted(k.name for k in parse_api_keys(s.api_keys_text)) == ["bob", "key2"]


async def test_401_without_a_valid_key_and_200_with_each_key(make_client, vllm):  # noqa: F811
    async with make_client(make_config(), secrets=RouterSecrets(api_keys_text=f"{ALICE}\n{BOB} name=bob")) as (c, _):
        for headers in ({}, bearer("wrong-key-123"), {"authorization": ALICE}, {"authorization": "Basic " + ALICE},
                        {"authorization": "Bearer "}, bearer(ALICE + "x"), bearer(ALICE[:-1])):
            r = await c.post("/v1/completions", json=CLIENT, headers=headers)
            assert r.status_code == 401, headers
            assert r.json()["error"]["type"] == "authentication_error"
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert ALICE not in r.text
        assert (await c.get("/v1/models")).status_code == 401
        assert (await c.post("/tokenize", json={"prompt": "x"})).status_code == 401
        for key in (ALICE, BOB):
            r = await c.post("/v1/completions", json=CLIENT, headers=bearer(key))
            assert r.status_code == 200, r.text
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/metrics")).status_code == 200
    # a 401 never reaches an upstream
    assert len(vllm.bodies("http://prefill:8000", "/v1/completions")) == 2


async def test_body_is_not_read_before_the_key_is_checked(make_client, vllm):  # noqa: F811
    async with make_client(make_config(limits={"max_body_bytes": 2048}),
                           secrets=RouterSecrets(api_keys_text=ALICE)) as (c, _):
        r = await c.post("/v1/completions", content=b"x" * 10_000)
    assert r.status_code == 401  # not 413: an unauthenticated client cannot make the router read anything


async def test_lane_permission_is_per_key(make_client, vllm):  # noqa: F811
    async with make_client(make_config(), secrets=RouterSecrets(api_keys_text=f"{ALICE}\n{BOB} name=bob lanes=native")
                           ) as (c, _):
        r = await c.post("/v1/completions", json=dict(CLIENT, model="tiny-x"), headers=bearer(BOB))
        assert r.status_code == 403
        assert r.json()["error"]["type"] == "permission_error" and "'bob'" in r.json()["error"]["message"]
        assert BOB not in r.text
        r = await c.post("/v1/completions", json=dict(CLIENT, model="tiny-x"),
                         headers={**bearer(BOB), "X-Lane": "native"})
        assert r.status_code == 200 and r.headers["x-expresslane-lane"] == "native"
        assert (await c.post("/v1/completions", json=CLIENT, headers=bearer(BOB))).status_code == 200


async def test_rate_limit_is_per_key_with_retry_after(make_client, vllm):  # noqa: F811
    clock = Clock()
    secrets = RouterSecrets(api_keys_text=f"{ALICE}\n{BOB} name=bob rps=0.5")
    async with make_client(make_config(), secrets=secrets, clock=clock) as (c, _):
        assert (await c.post("/v1/completions", json=CLIENT, headers=bearer(BOB))).status_code == 200
        r = await c.post("/v1/completions", json=CLIENT, headers=bearer(BOB))
        assert r.status_code == 429 and r.headers["retry-after"] == "2"
        assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == "rate_limit_exceeded"
        for _ in range(3):  # alice has no limit, and bob's bucket does not slow her down
            assert (await c.post("/v1/completions", json=CLIENT, headers=bearer(ALICE))).status_code == 200
        clock.t += 2.0
        assert (await c.post("/v1/completions", json=CLIENT, headers=bearer(BOB))).status_code == 200
    assert len(vllm.bodies("http://prefill:8000", "/v1/completions")) == 5


async def test_keys_never_reach_the_log(make_client, vllm, caplog):  # noqa: F811
    caplog.set_level(logging.DEBUG)
    async with make_client(make_config(), secrets=RouterSecrets(api_keys_text=f"{ALICE}\n{BOB} name=bob rps=0.001")
                           ) as (c, _):
        await c.post("/v1/completions", json=CLIENT, headers=bearer("sk-guess-" + ALICE))
        await c.post("/v1/completions", json=CLIENT, headers=bearer(BOB))
        await c.post("/v1/completions", json=CLIENT, headers=bearer(BOB))
    assert "401" in caplog.text and "429" in caplog.text
    for secret in (ALICE, BOB):
        assert secret not in caplog.text


async def test_no_keys_means_open_with_one_warning(make_client, vllm, caplog):  # noqa: F811
    caplog.set_level(logging.WARNING)
    async with make_client(make_config(), secrets=RouterSecrets()) as (c, _):
        assert (await c.post("/v1/completions", json=CLIENT)).status_code == 200
    assert sum("no client API keys configured" in r.message for r in caplog.records) == 1


async def test_the_open_warning_names_the_listen_address_and_missing_upstream_secrets(make_client, vllm, caplog):  # noqa: F811
    caplog.set_level(logging.WARNING)
    async with make_client(make_config(), secrets=RouterSecrets(vllm_api_key="vk")):
        pass
    text = caplog.text
    assert "open to anyone who can reach 0.0.0.0:8080" in text and "127.0.0.1" in text
    assert "EXPRESS_NODE_TOKEN not set" in text and "VLLM_API_KEY and" not in text  # the key that is set is not named
