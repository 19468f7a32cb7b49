"""Config loading: precedence CLI > env > file > defaults, docs on every field."""

import json

import pytest
from pydantic import ValidationError

import rlfleet.services.collector.config  # noqa: F401 - registers the subclasses below
import rlfleet.services.generation.config  # noqa: F401
import rlfleet.services.reference.config  # noqa: F401
import rlfleet.services.reward.config  # noqa: F401
import rlfleet.services.trajectory.config  # noqa: F401
from rlfleet.services.common.config import ServiceConfig
from rlfleet.services.echo.config import EchoConfig


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
    classes, todo = [], [ServiceConfig]
    while todo:
        cls = todo.pop()
        classes.append(cls)
        todo.extend(cls.__subclasses__())
    return classes


@pytest.mark.parametrize("cls", all_config_classes(), ids=lambda c: c.__name__)
def test_every_config_field_is_documented(cls):
    undocumented = [name for name, field in cls.model_fields.items() if not field.description]
    assert not undocumented, f"{cls.__name__} fields without a docstring: {undocumented}"


@pytest.mark.parametrize("cls", all_config_classes()[1:], ids=lambda c: c.__name__)
def test_every_service_has_working_help_and_env_prefix(cls):
    text = cls.argument_parser().format_help()
    assert "--port" in text and cls.env_prefix() in text
    assert cls.service_name != "service"
