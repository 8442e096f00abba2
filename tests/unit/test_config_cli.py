"""Settings: file, environment and CLI precedence; check-config's plain-language errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import main
from gateway.config import ConfigError, load_settings

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_config_is_valid_and_matches_defaults() -> None:
    shipped = load_settings(ROOT / "config" / "vllm-guard.yaml")
    assert shipped == load_settings(None)


def test_precedence_cli_over_env_over_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("server: {port: 1111, workers: 2}\nguard: {max_attempts: 2}\n")
    monkeypatch.setenv("VLLM_GUARD_SERVER__PORT", "2222")
    monkeypatch.setenv("VLLM_GUARD_GUARD__MODE", "observe")
    settings = load_settings(config, {"server": {"port": 3333}})
    assert settings.server.port == 3333
    assert settings.server.workers == 2
    assert settings.guard.mode == "observe"
    assert settings.guard.max_attempts == 2
    monkeypatch.delenv("VLLM_GUARD_SERVER__PORT")
    assert load_settings(config).server.port == 1111


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("guard: {max_atempts: 3}", "guard.max_atempts: unknown setting"),
        ("guard: {mode: maybe}", "guard.mode"),
        ("upstream: {backends: []}", "at least one backend"),
        ("upstream: {backends: [{name: a, url: 'x'}]}", "must look like http://host:port"),
        ("guard: {detectors: {deny_patterns: ['(']}}", "not a valid regex"),
        ("- a list", "mapping at the top level"),
        ("key: [unclosed", "not valid YAML"),
        (
            "upstream: {backends: [{name: a, url: 'http://a', role: fixed}]}",
            "role 'primary'",
        ),
    ],
)
def test_check_config_explains_problems(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, fragment: str
) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    assert main(["check-config", str(config)]) == 1
    assert fragment in capsys.readouterr().err
    with pytest.raises(ConfigError):
        load_settings(config)


def test_check_config_ok(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", str(ROOT / "config" / "vllm-guard.yaml")]) == 0
    assert "OK" in capsys.readouterr().out


def test_missing_file_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings("/nonexistent/vllm-guard.yaml")
