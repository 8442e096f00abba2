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
    assert main(["check-config", str(config)]) == 2  # the code serve exits with
    assert fragment in capsys.readouterr().err
    with pytest.raises(ConfigError):
        load_settings(config)


def test_check_config_ok(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", str(ROOT / "config" / "vllm-guard.yaml")]) == 0
    assert "OK" in capsys.readouterr().out


def test_missing_file_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings("/nonexistent/vllm-guard.yaml")


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("server: {log_level: verbose}", "server.log_level"),
        ("metrics: {multiproc_dir: /}", "system directory"),
        ("metrics: {multiproc_dir: /etc/}", "system directory"),
        ("metrics: {multiproc_dir: relative/dir}", "absolute path"),
    ],
)
def test_check_config_refuses_what_serve_would_crash_on_or_regret(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, fragment: str
) -> None:
    """`log_level: verbose` passed check-config, then serve crashed with a KeyError;
    `multiproc_dir: /` passed, and serve deleted the directory's contents."""
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    assert main(["check-config", str(config)]) == 2
    assert fragment in capsys.readouterr().err
    assert main(["serve", "--config", str(config)]) == 2  # the same code, before starting


def test_settings_that_do_nothing_are_warned_about(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "noop.yaml"
    config.write_text("guard: {retry_target: fixed, canary_weight: 0.1}\n")
    assert main(["check-config", str(config)]) == 0
    err = capsys.readouterr().err
    assert "retry_target is 'fixed' but no backend has role 'fixed'" in err
    assert "canary_weight is set but no backend has role 'fixed'" in err


def test_an_environment_variables_error_names_the_variable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_GUARD_SERVER__PORT", "eighty")
    config = tmp_path / "ok.yaml"
    config.write_text("{}\n")
    assert main(["check-config", str(config)]) == 2
    assert "VLLM_GUARD_SERVER__PORT" in capsys.readouterr().err


def test_multiprocess_files_go_to_a_directory_of_their_own(tmp_path: Path) -> None:
    """The configured directory was deleted wholesale at start-up."""
    from gateway.cli import _prepare_multiprocess_metrics

    mine = tmp_path / "keep-me.txt"
    mine.write_text("not the gateway's")
    settings = load_settings(
        None, {"server": {"workers": 2}, "metrics": {"multiproc_dir": str(tmp_path)}}
    )
    import os

    before = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    try:
        _prepare_multiprocess_metrics(settings)
        directory = Path(os.environ["PROMETHEUS_MULTIPROC_DIR"])
        assert directory.parent == tmp_path
        assert directory.name.startswith("vllm-guard-metrics-")
        assert mine.read_text() == "not the gateway's"
    finally:
        if before is None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = before


def test_redis_url_blank_is_unset_and_a_bad_scheme_is_refused() -> None:
    from pydantic import ValidationError

    from gateway.config import Settings

    assert Settings.model_validate({"state": {"redis_url": ""}}).state.redis_url is None
    shared = Settings.model_validate({"state": {"redis_url": "redis://:pw@cache:6379/0"}})
    assert shared.state.redis_url is not None
    assert "pw" not in repr(shared.state)  # a secret: never printed
    with pytest.raises(ValidationError, match="redis://"):
        Settings.model_validate({"state": {"redis_url": "http://cache:6379"}})


def test_workers_get_the_settings_with_their_secrets() -> None:
    """``serve --workers N`` hands its settings to the workers as JSON: secrets must
    arrive as they are, not as pydantic's ``**********``."""
    from gateway.cli import resolved_settings_json
    from gateway.config import Settings

    settings = Settings.model_validate(
        {
            "guard": {"salt_reuse": {"key": "ladder-secret"}, "mode": "observe"},
            "state": {"redis_url": "redis://:pw@cache:6379/0"},
            "upstream": {"backends": [{"name": "a", "url": "http://127.0.0.1:8000"}]},
        }
    )
    worker = Settings.model_validate_json(resolved_settings_json(settings))
    assert worker == settings
    assert worker.guard.salt_reuse.key is not None
    assert worker.guard.salt_reuse.key.get_secret_value() == "ladder-secret"
    assert worker.state.redis_url is not None
    assert worker.state.redis_url.get_secret_value() == "redis://:pw@cache:6379/0"
