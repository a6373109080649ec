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


def _identities(tmp_path):
    from temper.runtime.tls import issue, make_ca, write_identity

    ca, ca_key = make_ca("collector CA")
    other, other_key = make_ca("another CA")
    return (write_identity(tmp_path / "mine", ca, *issue(ca, ca_key, "temper")),
            write_identity(tmp_path / "other", other, *issue(other, other_key, "temper")))


def test_otlp_is_plaintext_unless_tls_is_asked_for_or_implied(tmp_path):
    mine, _ = _identities(tmp_path)
    assert not load_config(DemoConfig, ["--otlp-endpoint", "collector:4317"]).otlp_uses_tls()  # today's default
    assert load_config(DemoConfig, ["--otlp-endpoint", "https://collector:4317"]).otlp_uses_tls()
    assert load_config(DemoConfig, ["--otlp-endpoint", "collector:4317", "--otlp-tls"]).otlp_uses_tls()
    f = tmp_path / "c.toml"
    f.write_text(f'[demo]\notlp_endpoint = "collector:4317"\notlp_ca_file = "{mine / "ca.crt"}"\n'
                 f'otlp_cert_file = "{mine / "tls.crt"}"\notlp_key_file = "{mine / "tls.key"}"\n')
    c = load_config(DemoConfig, ["--config", str(f)])
    assert c.otlp_uses_tls() and c.otlp_key_file == str(mine / "tls.key")


def _otlp_errors(argv) -> list[str]:
    import pytest
    from pydantic import ValidationError

    from temper.runtime.config import describe_errors

    with pytest.raises(ValidationError) as e:
        load_config(DemoConfig, argv)
    return describe_errors(DemoConfig, e.value, argv)


def test_a_bad_otlp_tls_file_is_an_error_naming_its_key(tmp_path):
    mine, other = _identities(tmp_path)
    missing = str(tmp_path / "nope.crt")
    assert _otlp_errors(["--otlp-ca-file", missing]) == [
        f"[demo] otlp_ca_file: cannot read the file: No such file or directory (got {missing!r}) "
        "[from flag --otlp-ca-file]"]
    (tmp_path / "garbage.crt").write_text("not a certificate\n")
    for not_a_cert in (tmp_path / "garbage.crt", mine / "tls.key"):
        [line] = _otlp_errors(["--otlp-ca-file", str(not_a_cert)])
        assert line.startswith("[demo] otlp_ca_file: not a PEM certificate file")
    [line] = _otlp_errors(["--otlp-cert-file", str(mine / "tls.key"), "--otlp-key-file", str(mine / "tls.key")])
    assert line.startswith("[demo] otlp_cert_file: not a PEM certificate file")


def test_the_otlp_client_certificate_and_key_go_together_and_must_match(tmp_path):
    mine, other = _identities(tmp_path)
    cert, key = ["--otlp-cert-file", str(mine / "tls.crt")], ["--otlp-key-file", str(mine / "tls.key")]
    for half in (cert, key):
        [line] = _otlp_errors(half)
        assert line.startswith("[demo] otlp_key_file: otlp_cert_file and otlp_key_file go together")
    [line] = _otlp_errors([*cert, "--otlp-key-file", str(other / "tls.key")])
    assert line.startswith("[demo] otlp_key_file: not the private key of otlp_cert_file")
    [line] = _otlp_errors([*cert, "--otlp-key-file", str(mine / "tls.crt")])
    assert line.startswith("[demo] otlp_key_file: not an unencrypted PEM private key")
    secret = (other / "tls.key").read_text().splitlines()[1]  # a line of the key's base64 body
    assert all(secret not in line for line in _otlp_errors([*cert, "--otlp-key-file", str(other / "tls.key")]))
    assert load_config(DemoConfig, [*cert, *key]).otlp_uses_tls()
