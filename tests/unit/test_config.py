"""Config loading (pydantic-settings): precedence CLI > env > file > defaults, docs on every field."""

import json

import pytest
from pydantic import ValidationError

import rlfleet.services.generation.config  # noqa: F401 - registers the subclasses below
import rlfleet.services.reference.config  # noqa: F401
import rlfleet.services.reward.config  # noqa: F401
import rlfleet.services.trajectory.config  # noqa: F401
import rlfleet.services.viewer.config  # noqa: F401 - a Settings subclass, not a ServiceConfig one
from rlfleet.services.collector.config import CollectorConfig
from rlfleet.services.common.config import Settings
from tests.echo_service.config import EchoConfig


def test_precedence_cli_over_env_over_file(tmp_path):
    path = tmp_path / "echo.yaml"
    path.write_text("port: 1\nlog_level: WARNING\nstartup_delay_seconds: 3\n")
    env = {"RLFLEET_ECHO_PORT": "2", "RLFLEET_ECHO_LOG_LEVEL": "ERROR"}
    config = EchoConfig.load(["--config", str(path), "--port", "3"], environ=env)
    assert (config.port, config.log_level, config.startup_delay_seconds) == (3, "ERROR", 3.0)


def test_json_file_and_defaults(tmp_path):
    path = tmp_path / "echo.json"
    path.write_text(json.dumps({"grace_seconds": 1.5}))
    config = EchoConfig.load(["--config", str(path)], environ={})
    assert config.grace_seconds == 1.5 and config.port == 50059


def test_unknown_and_invalid_fields_are_rejected(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("no_such_field: 1\n")
    with pytest.raises(ValidationError, match="no_such_field"):
        EchoConfig.load(["--config", str(path)], environ={})
    with pytest.raises(ValidationError, match="port"):
        EchoConfig.load(["--port", "70000"], environ={})


def all_config_classes():
    """Every config class of the processes (the services' and the viewer's), with their bases."""
    classes, todo = [], [Settings]
    while todo:
        cls = todo.pop()
        classes.append(cls)
        todo.extend(cls.__subclasses__())
    return classes


@pytest.mark.parametrize("cls", all_config_classes(), ids=lambda c: c.__name__)
def test_every_config_field_is_documented(cls):
    undocumented = [name for name, field in cls.model_fields.items() if not field.description]
    assert not undocumented, f"{cls.__name__} fields without a docstring: {undocumented}"


@pytest.mark.parametrize("cls", [c for c in all_config_classes() if c.service_name != "service"],
                         ids=lambda c: c.__name__)
def test_every_service_has_working_help_and_env_prefix(cls):
    text = cls.argument_parser().format_help()
    assert "--port" in text and cls.env_prefix() in text
    assert cls.service_name != "service"


def test_each_layer_overrides_the_one_below(tmp_path):
    path = tmp_path / "echo.yaml"
    path.write_text("port: 1\ngrace_seconds: 1\nkeepalive_seconds: 1\n")
    env = {"RLFLEET_ECHO_PORT": "2", "RLFLEET_ECHO_GRACE_SECONDS": "2"}
    config = EchoConfig.load(["--config", str(path), "--port=3"], environ=env)
    # port: file < env < CLI; grace: file < env; keepalive: file only; metrics_port: the default.
    assert (config.port, config.grace_seconds, config.keepalive_seconds, config.metrics_port) == (3, 2.0, 1.0, 0)


def test_both_flag_forms_and_the_last_flag_wins():
    assert EchoConfig.load(["--grace-seconds", "4", "--log-format=text"], environ={}).log_format == "text"
    config = CollectorConfig.load(["--generation-addresses", '["a:1"]', "--generation-addresses=[\"b:2\"]",
                                   "--port", "1", "--port", "2"], environ={})
    assert (config.generation_addresses, config.port) == (["b:2"], 2)


def test_constructing_a_config_reads_no_environment(monkeypatch):
    monkeypatch.setenv("RLFLEET_ECHO_PORT", "7")
    assert EchoConfig().port == 50059
    assert EchoConfig.load([]).port == 7  # load() reads os.environ unless given a mapping
    assert EchoConfig.load([], environ={}).port == 50059


@pytest.mark.parametrize("text", ["[abc", "{x", "[1, 2]", '{"a": 1}', "null-ish", "123"])
def test_string_fields_keep_any_text(tmp_path, text):
    flags = CollectorConfig.load(["--reward-fn", text, f"--upstream-auth-token={text}"], environ={})
    assert (flags.reward_fn, flags.upstream_auth_token) == (text, text)
    env = CollectorConfig.load([], environ={"RLFLEET_COLLECTOR_REWARD_FN": text})
    assert env.reward_fn == text
    path = tmp_path / "collector.json"
    path.write_text(json.dumps({"reward_fn": text}))
    assert CollectorConfig.load(["--config", str(path)], environ={}).reward_fn == text


def test_dict_and_list_fields_take_json_from_flags_and_env():
    sampling = {"temperature": 0.5, "max_tokens": 8, "stop": ["[abc", "{x"]}
    flags = CollectorConfig.load(["--sampling", json.dumps(sampling),
                                  "--generation-addresses", '["g1:1", "g2:2"]'], environ={})
    env = CollectorConfig.load([], environ={"RLFLEET_COLLECTOR_SAMPLING": json.dumps(sampling),
                                            "RLFLEET_COLLECTOR_GENERATION_ADDRESSES": '["g1:1", "g2:2"]'})
    for config in (flags, env):
        assert config.sampling == sampling and config.generation_addresses == ["g1:1", "g2:2"]


@pytest.mark.parametrize("field,flag", [("sampling", "--sampling"),
                                        ("generation_addresses", "--generation-addresses")])
@pytest.mark.parametrize("bad", ["{temperature: 1", "[abc", "[1,"])
def test_bad_json_is_a_validation_error_naming_the_field(field, flag, bad):
    with pytest.raises(ValidationError, match=rf"(?s){field}.*invalid JSON"):
        CollectorConfig.load([flag, bad], environ={})
    with pytest.raises(ValidationError, match=rf"(?s){field}.*invalid JSON"):
        CollectorConfig.load([], environ={f"RLFLEET_COLLECTOR_{field.upper()}": bad})


def test_null_on_the_command_line_unsets_an_optional_field(tmp_path):
    path = tmp_path / "collector.yaml"
    path.write_text("max_push_bytes: 100\n")
    assert CollectorConfig.load(["--config", str(path)], environ={}).max_push_bytes == 100
    assert CollectorConfig.load(["--config", str(path), "--max-push-bytes", "null"], environ={}).max_push_bytes is None


@pytest.mark.parametrize("argv", [["--prot", "3"], ["--por", "3"], ["--port_file", "x"], ["--no-such-field=1"]])
def test_unknown_or_abbreviated_flags_are_refused_by_name(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        EchoConfig.load(argv, environ={})
    assert exited.value.code == 2
    assert "unrecognized arguments: " + argv[0] in capsys.readouterr().err


def test_unknown_file_key_and_missing_file_are_refused(tmp_path):
    path = tmp_path / "typo.json"
    path.write_text(json.dumps({"prot": 1}))
    with pytest.raises(ValidationError, match="prot"):
        EchoConfig.load(["--config", str(path)], environ={})
    with pytest.raises(FileNotFoundError):
        EchoConfig.load(["--config", str(tmp_path / "absent.yaml")], environ={})
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="mapping"):
        EchoConfig.load(["--config", str(path)], environ={})


@pytest.mark.parametrize("cls", all_config_classes()[1:], ids=lambda c: c.__name__)
def test_help_lists_every_field_with_its_docstring(cls):
    text = "".join(cls.argument_parser().format_help().split())  # argparse re-wraps the docstrings
    for name, field in cls.model_fields.items():
        assert "--" + name.replace("_", "-") in text
        assert "".join(field.description.split()) in text, f"{cls.__name__}.{name}"


@pytest.mark.parametrize("fields, message", [
    ({"players": {"opponent": "r1"}}, "players: another run's policy plays on replicas shared between runs"),
    ({"players": {"opponent": "not a run"}, "shared_replicas": True}, r"players\['opponent'\]: 'not a run' is not a run name"),
    ({"players": {"": "r1"}, "shared_replicas": True}, "is not a player's name"),
    ({"run_name": "not/a name"}, "run_name"),
])
def test_players_name_runs_on_shared_replicas(fields, message):
    with pytest.raises(ValueError, match=message):
        CollectorConfig(**fields)
    assert CollectorConfig(players={"opponent": "r1"}, shared_replicas=True, run_name="r0").players == {"opponent": "r1"}
