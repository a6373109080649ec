from temper.runtime.config import ServiceConfig, load_config


class DemoConfig(ServiceConfig):
    section = "demo"
    lr: float = 1.0
    addresses: list[str] = ["a"]


def test_precedence_flags_over_env_over_file_over_defaults(tmp_path, monkeypatch):
    f = tmp_path / "c.toml"
    f.write_text('[demo]\nlr = 2.0\nport = 7\nlog_level = "DEBUG"\n[other]\nlr = 9.0\n')
    assert load_config(DemoConfig, []).lr == 1.0
    c = load_config(DemoConfig, ["--config", str(f)])
    assert (c.lr, c.port, c.log_level) == (2.0, 7, "DEBUG")
    monkeypatch.setenv("TEMPER_DEMO_LR", "3.0")
    monkeypatch.setenv("TEMPER_DEMO_PORT", "8")
    c = load_config(DemoConfig, ["--config", str(f)])
    assert (c.lr, c.port) == (3.0, 8)
    c = load_config(DemoConfig, ["--config", str(f), "--lr", "4.0", "--addresses", "x,y"])
    assert (c.lr, c.port, c.addresses) == (4.0, 8, ["x", "y"])


def test_unknown_keys_are_rejected(tmp_path):
    import pytest
    from pydantic import ValidationError

    f = tmp_path / "c.toml"
    f.write_text("[demo]\nlearning_rate = 2.0\n")
    with pytest.raises(ValidationError, match="learning_rate"):
        load_config(DemoConfig, ["--config", str(f)])
