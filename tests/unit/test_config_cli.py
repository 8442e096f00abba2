"""Settings: file, environment and CLI precedence; check-config's plain-language errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from gateway.cli import main
from gateway.config import ConfigError, Settings, load_settings

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


def test_demo_without_a_checkout_says_exactly_what_it_needs(tmp_path: Path) -> None:
    """Installed without the source tree, ``vllm-guard demo`` names the files it lacks
    and where it looked, and exits without starting anything."""
    env = {**os.environ, "VLLM_GUARD_SUPPORT_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "demo", "--json"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    assert "install_vllm.sh, build_tiny_model.py, poison_scheduler.py" in done.stderr
    assert str(tmp_path) in done.stderr
    assert "Traceback" not in done.stderr


def setting_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every setting's dotted path (nested sections walked; a list of models or a
    mapping of models is one setting: its items are documented by example)."""
    paths = []
    for name, field in model.model_fields.items():
        path = prefix + name
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            paths += setting_paths(annotation, path + ".")
        else:
            paths.append(path)
    return paths


def documented_paths(text: str) -> set[str]:
    """The dotted paths of config/vllm-guard.yaml's keys, commented-out ones included."""
    paths: set[str] = set()
    stack: list[tuple[int, str]] = []
    for line in text.splitlines():
        match = re.match(r"^(\s*)(?:#\s?)?(\s*)(?:- )?([a-z_][a-z0-9_]*):(\s|$)", line)
        if not match:
            continue
        indent = len(match[1]) + len(match[2])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([*(key for _, key in stack), match[3]])
        paths.add(path)
        stack.append((indent, match[3]))
    return paths


def test_the_documented_config_lists_every_setting() -> None:
    """config/vllm-guard.yaml says it lists every setting: each one the model
    accepts is there (as a key or a commented example), and nothing else."""
    documented = documented_paths((ROOT / "config" / "vllm-guard.yaml").read_text())
    missing = [path for path in setting_paths(Settings) if path not in documented]
    assert missing == []


def test_a_list_setting_from_the_environment_takes_json_or_commas(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first, second = "a" * 64, "b" * 64
    monkeypatch.setenv("VLLM_GUARD_AUTH__API_KEY_SHA256", f"{first}, {second}")
    assert load_settings().auth.api_key_sha256 == [first, second]
    monkeypatch.setenv("VLLM_GUARD_AUTH__API_KEY_SHA256", f'["{first}"]')
    assert load_settings().auth.api_key_sha256 == [first]


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("VLLM_GUARD_AUTH__API_KEY_SHA256", "not-a-digest"),
        ("VLLM_GUARD_SERVER__PORT", "eighty"),
        ("VLLM_GUARD_MODELS", "{not json"),
        ("VLLM_GUARD_UPSTREAM__BACKENDS", "http://vllm:8000"),
    ],
)
def test_a_bad_environment_value_exits_2_naming_the_variable(variable: str, value: str) -> None:
    env = {**os.environ, variable: value}
    for command in (["check-config", str(ROOT / "config" / "vllm-guard.yaml")], ["serve"]):
        done = subprocess.run(
            [sys.executable, "-m", "gateway.cli", *command],
            capture_output=True, text=True, env=env, timeout=60,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert variable in done.stderr
        assert "Traceback" not in done.stderr


def test_workers_without_a_configured_key_share_one_drawn_by_the_parent(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every worker reads the parent's resolved settings: one key drawn there is every
    worker's ladder key. One worker keeps drawing its own; a configured key stays."""
    from gateway.cli import resolved_settings_json, with_workers_key

    two = Settings.model_validate({"server": {"workers": 2}})
    drawn = with_workers_key(two)
    key = drawn.guard.salt_reuse.key
    assert key is not None
    assert len(key.get_secret_value()) == 64
    worker = Settings.model_validate_json(resolved_settings_json(drawn))
    assert worker.guard.salt_reuse.key == key
    assert "replicas need the same configured key" in capsys.readouterr().err
    assert with_workers_key(Settings()).guard.salt_reuse.key is None
    configured = Settings.model_validate(
        {"server": {"workers": 2}, "guard": {"salt_reuse": {"key": "k"}}}
    )
    assert with_workers_key(configured) is configured


def test_an_evidence_path_that_cannot_be_written_is_said_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Under a read-only root filesystem (here: a path below a file, which no user
    can create) the gateway says what to mount and runs without evidence."""
    from gateway.server.lifespan import open_evidence

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    settings = Settings.model_validate(
        {"evidence": {"enabled": True, "path": str(blocker / "evidence.jsonl")}}
    )
    with caplog.at_level("ERROR", logger="vllm_guard"):
        assert open_evidence(settings) is None
    assert "mount a writable volume" in caplog.text
    assert str(blocker / "evidence.jsonl") in caplog.text
    writable = Settings.model_validate(
        {"evidence": {"enabled": True, "path": str(tmp_path / "ok" / "evidence.jsonl")}}
    )
    assert open_evidence(writable) is not None


def test_workers_get_the_settings_from_a_file_only_the_owner_can_read() -> None:
    """The resolved settings, secrets included, reach the workers in an anonymous
    in-memory file that only this user's processes can open (``/proc/<pid>/fd/<n>``)
    and that is gone with the process, even one killed by a signal; the environment
    (which /proc/<pid>/environ shows and every child process inherits) carries only
    its path. They were in an environment variable, and a file on disk outlived a
    SIGKILL."""
    import subprocess
    import sys

    from gateway.cli import settings_for_workers
    from gateway.config import RESOLVED_SETTINGS_FILE_ENV, Settings, settings_from_environment

    settings = Settings.model_validate(
        {
            "guard": {"salt_reuse": {"key": "ladder-secret"}},
            "state": {"redis_url": "redis://:redis-secret@cache:6379/0"},
            "upstream": {"api_key": "upstream-secret"},
        }
    )
    secrets = ("ladder-secret", "redis-secret", "upstream-secret")
    with settings_for_workers(settings) as path:
        assert os.environ[RESOLVED_SETTINGS_FILE_ENV] == path
        assert path.startswith(f"/proc/{os.getpid()}/fd/")
        assert os.readlink(path).startswith("/memfd:")  # on no filesystem
        assert settings_from_environment() == settings  # what a worker reads
        child = subprocess.run(
            [sys.executable, "-c", "import os; print(dict(os.environ))"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert path in child.stdout
        assert not any(secret in child.stdout for secret in secrets)
        # Another process of this user reads it by its path, as spawned workers do.
        reader = subprocess.run(
            [sys.executable, "-c", f"print(open({path!r}).read())"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert "ladder-secret" in reader.stdout
    assert not os.path.exists(path)
    assert RESOLVED_SETTINGS_FILE_ENV not in os.environ
    # A server killed by SIGKILL leaves nothing behind.
    killed = subprocess.run(
        [sys.executable, "-c",
         "import os, signal\n"
         "from gateway.cli import settings_for_workers\n"
         "from gateway.config import Settings\n"
         "with settings_for_workers(Settings()) as path:\n"
         "    print(path, flush=True)\n"
         "    os.kill(os.getpid(), signal.SIGKILL)\n"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert killed.returncode == -9
    assert not os.path.exists(killed.stdout.strip())
    import tempfile

    assert not list(Path(tempfile.gettempdir()).glob("vllm-guard-settings-*"))


def test_a_trusted_proxy_names_the_client_for_the_fair_share() -> None:
    """Behind a listed proxy the client is the nearest address in X-Forwarded-For
    that is not a trusted proxy (a client may prepend anything to the left); a peer
    that is not listed is the client whatever it claims."""
    import ipaddress

    from gateway.server.auth import TrustedProxies, client_identity

    proxies = TrustedProxies([ipaddress.ip_network("10.0.0.0/8")])

    def scope(peer: str, forwarded: str | None) -> dict[str, object]:
        headers = [(b"x-forwarded-for", forwarded.encode())] if forwarded else []
        return {"client": (peer, 4711), "headers": headers}

    def who(peer: str, forwarded: str | None = None) -> str:
        return client_identity(scope(peer, forwarded), by_key=False, proxies=proxies)

    assert who("10.1.2.3", "198.51.100.7") == "addr:198.51.100.7"
    assert who("10.1.2.3", "6.6.6.6, 198.51.100.7, 10.9.9.9") == "addr:198.51.100.7"
    assert who("10.1.2.3") == "addr:10.1.2.3"  # nothing forwarded: the proxy itself
    assert who("203.0.113.5", "198.51.100.7") == "addr:203.0.113.5"  # not trusted
    nobody = TrustedProxies([])
    assert (
        client_identity(scope("10.1.2.3", "198.51.100.7"), by_key=False, proxies=nobody)
        == "addr:10.1.2.3"
    )


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"cpu.max": "200000 100000\n"}, 2),  # cgroup v2, a limit of 2 CPUs
        ({"cpu.max": "150000 100000\n"}, 2),  # 1.5 CPUs: rounded up
        ({"cpu.max": "50000 100000\n"}, 1),  # half a CPU: one worker
        ({"cpu.max": "max 100000\n"}, 8),  # no limit: the affinity
        ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3),  # v1
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, 8),  # v1, none
        ({"cpu.max": "6400000 100000\n"}, 8),  # a limit above the affinity: the affinity
        ({}, 8),  # no cgroup files at all
    ],
)
def test_workers_auto_counts_the_cpus_of_the_affinity_and_the_cgroup_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: dict[str, str], expected: int
) -> None:
    from gateway.config import usable_cpus

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert usable_cpus(tmp_path) == expected


def test_workers_auto_in_a_file_and_on_the_command_line_is_this_machines_cpus(
    tmp_path: Path,
) -> None:
    from gateway.cli import _serve_overrides, build_parser
    from gateway.config import usable_cpus

    config = tmp_path / "c.yaml"
    config.write_text("server: {workers: auto}\n")
    assert load_settings(config).server.workers == usable_cpus() >= 1
    args = build_parser().parse_args(["serve", "--workers", "auto"])
    assert load_settings(None, _serve_overrides(args)).server.workers == usable_cpus()
    with pytest.raises(ConfigError):
        load_settings(None, {"server": {"workers": "many"}})
