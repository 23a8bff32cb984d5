"""Router config: ${VAR:-default} interpolation, the shipped compose/config/router.yaml, validation errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from expresslane.router.config import ConfigError, ExpressPool, interpolate, load_config, parse_config

from ._kit import config_dict

REPO = Path(__file__).resolve().parents[3]
SHIPPED = REPO / "compose" / "config" / "router.yaml"


@pytest.mark.parametrize(
    "text,env,want",
    [
        ("${A:-x}", {}, "x"),
        ("${A:-x}", {"A": ""}, "x"),
        ("${A:-x}", {"A": "y"}, "y"),
        ("${A-x}", {"A": ""}, ""),
        ("${A-x}", {}, "x"),
        ("${A}", {"A": "v"}, "v"),
        ("${A:-}", {}, ""),
        ("http://${H:-127.0.0.1}:${P:-80}/", {"P": "81"}, "http://127.0.0.1:81/"),
        ("cost: $$5", {}, "cost: $5"),
        ("# ${UNSET} in a comment stays\nk: 1", {}, "# ${UNSET} in a comment stays\nk: 1"),
    ],
)
def test_interpolation_follows_compose_rules(text, env, want):
    assert interpolate(text, env) == want


def test_interpolating_an_unset_variable_without_default_fails_loudly():
    with pytest.raises(ConfigError, match=r"\$\{NOPE\} is not set"):
        interpolate("k: ${NOPE}", {})


def test_shipped_router_yaml_loads_with_defaults_and_types():
    cfg = load_config(SHIPPED, {})
    assert cfg.listen.port == 8080 and isinstance(cfg.listen.port, int)
    assert cfg.prefill.url is None and cfg.prefill.static_nodes == ["http://127.0.0.1:8000"]
    assert cfg.pools["native"].nodes == ["http://127.0.0.1:8100"]
    express = cfg.pools["express"]
    assert isinstance(express, ExpressPool) and express.kind == "expresslane"
    assert (express.nodes[0].url, express.nodes[0].ctrl_port) == ("http://127.0.0.1:5557", 5556)
    assert cfg.prefill.model == "smollm2-135m-instruct"  # the default stack's real model
    assert cfg.pools[cfg.aliases["smollm2-135m-instruct"].pool].lane == "native"
    assert cfg.pools[cfg.aliases["smollm2-135m-instruct-express"].pool].lane == "express"
    q = cfg.queue_for("smollm2-135m-instruct-express", "express")
    assert (q.when_full, q.spill_to, q.max_waiting) == ("spill", "native", 16)
    assert cfg.max_model_len is None
    assert cfg.limits.max_body_bytes == 16 * 1024 * 1024 and cfg.limits.max_json_depth == 64
    assert cfg.aliases["smollm2-135m-instruct-express"].unsupported == "native"


def test_shipped_router_yaml_takes_the_environment():
    env = {"ROUTER_PORT": "9999", "PREFILL_HOST": "prefill", "EXPRESS_CTRL_PORT": "7000",
           "EXPRESS_ADVERTISE_HOST": "10.1.2.3", "SERVED_MODEL_NAME": "glm", "ROUTER_API_KEY": "sk-1",
           "MAX_MODEL_LEN": "2048", "MODEL_DIR": "/m", "ROUTER_MAX_BODY_BYTES": "4096"}
    cfg = load_config(SHIPPED, env)
    assert cfg.listen.port == 9999
    assert cfg.prefill.static_nodes == ["http://prefill:8000"] and cfg.prefill.model == "glm"
    assert sorted(cfg.aliases) == ["glm", "glm-express"]  # the aliases derive from the served model's name
    assert cfg.aliases["glm-express"].pool == "express" and cfg.aliases["glm"].pool == "native"
    node = cfg.pools["express"].nodes[0]
    assert (node.ctrl_host, node.ctrl_port) == ("10.1.2.3", 7000)
    assert cfg.max_model_len == 2048 and cfg.tokenizer_dir == "/m" and cfg.limits.max_body_bytes == 4096
    assert "sk-1" not in cfg.model_dump_json()  # the key never enters the config (RouterSecrets reads it)


@pytest.mark.parametrize(
    "change,needle",
    [
        (lambda d: d["aliases"].update(bad={"pool": "nope"}), "unknown pool 'nope'"),
        (lambda d: d["aliases"]["tiny-x"]["queue"].update(when_full="spill"), "spill_to"),
        (lambda d: d["aliases"]["tiny-x"]["queue"].update(when_full="spill", spill_to="express"),
         "not a configured native pool"),
        (lambda d: d.pop("tokenizer_dir"), "tokenizer_dir"),
        (lambda d: d["pools"]["native"].update(nodes=["not-a-url"]), "pools.native.native.nodes"),
        (lambda d: d["pools"]["native"].update(kind="vllm"), "pools.native"),
        (lambda d: d.update(typo_key=1), "typo_key"),
        (lambda d: d["aliases"]["tiny"].update(queue={"max_waiting": 1}), "only applies to an express pool"),
        (lambda d: d.update(lanes={"express": "native"}), "lanes.express"),
        (lambda d: d["pools"]["express"]["nodes"][0].update(ctrl_port=0), "ctrl_port"),
    ],
)
def test_invalid_configs_name_the_key(change, needle):
    d = config_dict()
    change(d)
    with pytest.raises(ConfigError) as e:
        parse_config(d, source="x.yaml")
    assert needle in str(e.value)
    assert "x.yaml" in str(e.value)


def test_missing_file_and_bad_yaml_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "none.yaml", {})
    p = tmp_path / "bad.yaml"
    p.write_text("pools: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p, {})


def test_entrypoint_check_prints_the_config_without_the_api_key(capsys):
    from expresslane.router.__main__ import main

    assert main(["--config", str(SHIPPED), "--check"]) == 0
    out = capsys.readouterr().out
    assert '"smollm2-135m-instruct-express"' in out and "api_key" not in out


def test_entrypoint_reports_config_errors_with_exit_2(tmp_path, capsys):
    from expresslane.router.__main__ import main

    p = tmp_path / "r.yaml"
    p.write_text("prefill: {url: 'http://x:1', model: m}\npools: {}\naliases: {}\n")
    assert main(["--config", str(p)]) == 2
    assert "invalid router config" in capsys.readouterr().err


def test_an_api_key_in_the_yaml_is_refused_with_the_way_out(tmp_path):
    # The key used to be pasted into the YAML text: a quote or backslash changed it, a YAML error echoed it.
    p = tmp_path / "r.yaml"
    p.write_text(SHIPPED.read_text() + '\napi_key: "sk-secret-value"\n')
    with pytest.raises(ConfigError) as e:
        load_config(p, {})
    assert "ROUTER_API_KEYS" in str(e.value) and "sk-secret-value" not in str(e.value)


def test_shipped_yaml_does_not_interpolate_any_secret():
    text = SHIPPED.read_text() + (SHIPPED.parent / "router.production.yaml").read_text()
    for name in ("ROUTER_API_KEY", "VLLM_API_KEY", "EXPRESS_NODE_TOKEN", "EXPRESSLANE_PEER_SECRET"):
        assert "${" + name not in text


def test_production_yaml_loads():
    cfg = load_config(SHIPPED.parent / "router.production.yaml", {"EXPRESS_ADVERTISE_HOST": "10.0.0.5"})
    assert cfg.pools["express"].kind == "tilert"
    assert cfg.aliases["glm-5.1-express"].unsupported == "native"


@pytest.mark.parametrize(
    "change,needle",
    [
        (lambda d: d["aliases"]["tiny-x"].update(unsupported="maybe"), "aliases.tiny-x.unsupported"),
        (lambda d: d.update(limits={"max_body_bytes": 10}), "limits.max_body_bytes"),
        (lambda d: d.update(limits={"max_json_depth": 1}), "limits.max_json_depth"),
        (lambda d: d.update(capabilities={"refresh_s": 0}), "capabilities.refresh_s"),
        (lambda d: (d["pools"].pop("native"), d["aliases"].pop("tiny"), d["aliases"].pop("tiny-xs"),
                    d["aliases"]["tiny-x"].update(unsupported="native")), "unsupported: native needs a native pool"),
    ],
)
def test_front_door_sections_are_validated(change, needle):
    d = config_dict()
    change(d)
    with pytest.raises(ConfigError) as e:
        parse_config(d, source="x.yaml")
    assert needle in str(e.value)


def test_an_express_only_config_is_valid_with_unsupported_refuse():
    d = config_dict()
    d["pools"].pop("native")
    d["aliases"] = {"tiny-x": {"pool": "express", "unsupported": "refuse"}}
    assert parse_config(d).aliases["tiny-x"].unsupported == "refuse"
