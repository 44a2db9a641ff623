"""ServerConfig and `pagoda serve`'s configuration: the serve.yaml sections, PAGODA_* variables,
flags, and errors that name the file and the key (raised before any model is loaded)."""

from pathlib import Path

import pytest
from pagoda.cli.main import build_parser
from pagoda.cli.main import main as pagoda_main
from pagoda.cli.serve import server_config_from_args
from pagoda.config import load_engine_config
from pagoda.errors import ConfigError
from pagoda.server.config import ServerConfig, load_server_config

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "serve.yaml"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for key in list(os.environ):
        if key.startswith("PAGODA_"):
            monkeypatch.delenv(key)


def test_example_serve_yaml_is_valid_and_uses_the_default_model():
    server = load_server_config(str(EXAMPLE))
    engine = load_engine_config(str(EXAMPLE))
    assert engine.model is None and engine.max_num_seqs == 32 and engine.enable_prefix_caching
    assert server.port == 8000 and server.max_queued_requests == 64 and server.api_keys == []


def test_file_then_environment_then_flags(tmp_path, monkeypatch):
    f = tmp_path / "serve.yaml"
    f.write_text("engine:\n  max_num_seqs: 4\nserver:\n  port: 9000\n  api_key: from-file\n  request_timeout: 5\n")
    monkeypatch.setenv("PAGODA_PORT", "9100")
    monkeypatch.setenv("PAGODA_API_KEY", "from-env")
    monkeypatch.setenv("PAGODA_CORS_ALLOW_ORIGINS", "http://a.example,http://b.example")
    args = build_parser().parse_args(["serve", "--config", str(f), "--request-timeout", "7", "--api-key", "flag",
                                      "--no-access-log", "--max-num-seqs", "6"])
    config = server_config_from_args(args)
    assert config.port == 9100  # env over file
    assert config.request_timeout == 7  # flag over file
    assert config.api_keys == ["flag"]  # flag over file and env
    assert config.cors_allow_origins == ["http://a.example", "http://b.example"]
    assert config.access_log is False
    from pagoda.cli.engine_args import engine_config_from_args

    assert engine_config_from_args(args).max_num_seqs == 6
    monkeypatch.delenv("PAGODA_PORT")
    assert load_server_config(str(f)).api_keys == ["from-env"]  # a later layer's keys replace earlier ones
    monkeypatch.delenv("PAGODA_API_KEY")
    assert load_server_config(str(f)).api_keys == ["from-file"]
    assert ServerConfig(api_key="a", api_keys=["b"]).api_keys == ["b", "a"]


@pytest.mark.parametrize("text,expected", [
    ("server:\n  prot: 80\n", ["unknown key 'prot'", "did you mean 'port'"]),
    ("server:\n  port: 99999\n", ["'port'", "65535"]),
    ("server:\n  max_queued_requests: 0\n", ["'max_queued_requests'", "greater than 0"]),
    ("server:\n  api_keys: ['']\n", ["'api_keys'", "non-empty"]),
    ("engien:\n  model: x\nserver: {}\n", ["unknown top-level key 'engien'"]),
    ("server: [1, 2]\n", ["'server' must be a mapping"]),
])
def test_bad_server_config_names_file_and_key(tmp_path, text, expected):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_server_config(str(f))
    message = str(info.value)
    assert all(e in message for e in expected), message
    if "top-level" not in message and "mapping" not in message:
        assert str(f) in message


def test_pagoda_serve_rejects_a_bad_file_before_loading_a_model(tmp_path, capsys):
    f = tmp_path / "serve.yaml"
    f.write_text("engine:\n  model: /nowhere\nserver:\n  request_timeout: soon\n")
    assert pagoda_main(["serve", "--config", str(f)]) == 1
    err = capsys.readouterr().err
    assert "request_timeout" in err and str(f) in err
    f.write_text("engine:\n  max_num_seq: 3\n")
    assert pagoda_main(["serve", "--config", str(f)]) == 1
    assert "did you mean 'max_num_seqs'" in capsys.readouterr().err
    assert pagoda_main(["serve", "--model", str(tmp_path / "missing")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_serve_help_lists_server_and_engine_flags(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for flag in ("--host", "--port", "--api-key", "--max-queued-requests", "--request-timeout", "--shutdown-timeout",
                 "--cors-allow-origins", "--model", "--served-model-name", "--enable-prefix-caching", "--config"):
        assert flag in text, flag
    assert set(ServerConfig.model_fields) >= {"host", "port", "api_keys", "served_model_name",
                                              "cors_allow_origins", "max_queued_requests", "request_timeout"}


def test_docs_list_every_server_key_with_its_default():
    text = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    rows = {line.split("|")[1].strip().strip("`"): line for line in text.splitlines() if line.startswith("| `")}
    for name, field in ServerConfig.model_fields.items():
        assert name in rows, f"docs/serving.md does not document server key {name!r}"
        default = field.default_factory() if field.default_factory else field.default
        shown = "null" if default is None else str(default).lower() if isinstance(default, bool) else \
            ("[]" if default == [] else f"{default:g}" if isinstance(default, float) else str(default))
        assert f"`{shown}`" in rows[name], (name, shown)


def test_a_busy_port_fails_before_the_model_is_loaded(tmp_path, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert pagoda_main(["serve", "--port", str(port), "--model", str(tmp_path / "not-loaded")]) == 1
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "does not exist" not in err


def test_serve_keeps_the_8192_token_step_unless_told(monkeypatch):
    """The platform's larger offline step budget is not what a server wants (decode latency)."""
    import pagoda.server.runner as runner

    seen = []

    def fake_bind(host, port):
        raise SystemExit(0)  # stop before loading a model

    monkeypatch.setattr(runner, "bind", fake_bind)
    import pagoda.cli.serve as serve

    real = serve.engine_config_from_args

    def capture(args):
        cfg = real(args)
        seen.append(cfg)
        return cfg

    monkeypatch.setattr(serve, "engine_config_from_args", capture)
    for flags, expected in (([], None), (["--max-num-batched-tokens", "2048"], 2048)):
        # on the CPU the budget stays unset: the CPU platform bounds a decoding stream's stall itself
        with pytest.raises(SystemExit):
            pagoda_main(["serve", "--device", "cpu", *flags])
        assert seen[-1].max_num_batched_tokens == expected
    monkeypatch.setattr(serve, "_on_cpu", lambda config: False)  # a GPU platform
    for flags, expected in (([], 8192), (["--max-num-batched-tokens", "2048"], 2048)):
        with pytest.raises(SystemExit):
            pagoda_main(["serve", *flags])
        assert seen[-1].max_num_batched_tokens == expected
