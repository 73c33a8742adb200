"""The ``llumdask`` command picks a command from its table, imports it lazily and hands it its arguments."""

from __future__ import annotations

import sys
import types

import pytest

import llumdask
from llumdask.api.cli import COMMANDS, Command, main


@pytest.fixture
def recorder(monkeypatch):
    """A command module `fake_llumdask_command` whose `run` records its arguments."""
    calls: list[list[str]] = []
    module = types.ModuleType("fake_llumdask_command")

    def run(args: list[str]) -> int | None:
        calls.append(args)
        return 3 if "--fail" in args else None

    module.run = run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return calls


COMMANDS_UNDER_TEST = {
    "fake": Command("fake_llumdask_command:run", "records its arguments"),
    "missing": Command("no_such_module_for_llumdask:main", "its module does not exist"),
}


def _exit_code(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as info:
        main(argv, COMMANDS_UNDER_TEST)
    return info.value.code


def test_unknown_command_exits_2_naming_it_and_the_choices(capsys):
    assert _exit_code(["bogus"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'bogus'" in err
    assert "'fake'" in err and "'missing'" in err


def test_missing_command_exits_2(capsys):
    assert _exit_code([]) == 2
    assert "required: COMMAND" in capsys.readouterr().err


def test_arguments_after_the_command_go_to_it_verbatim(recorder):
    argv = ["pos", "--help", "-n", "3", "--flag=x", "--", "-z"]
    assert main(["fake", *argv], COMMANDS_UNDER_TEST) == 0
    assert recorder == [argv]


def test_command_exit_status_is_returned(recorder):
    assert main(["fake", "--fail"], COMMANDS_UNDER_TEST) == 3


def test_help_lists_commands_without_importing_them(capsys):
    assert _exit_code(["--help"]) == 0
    out = capsys.readouterr().out
    assert "records its arguments" in out and "its module does not exist" in out
    with pytest.raises(ModuleNotFoundError, match="no_such_module_for_llumdask"):
        main(["missing"], COMMANDS_UNDER_TEST)


def test_version(capsys):
    assert _exit_code(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"llumdask {llumdask.__version__}"


@pytest.mark.parametrize("target", ["llumdask.api.demo", "llumdask.api.demo:", ":main", "llumdask.api.demo:main()"])
def test_malformed_target_is_rejected(target):
    with pytest.raises(ValueError, match="command target must look like"):
        Command(target, "help")


def test_demo_is_registered():
    assert COMMANDS["demo"].target == "llumdask.api.demo:main"
