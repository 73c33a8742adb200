"""`llumdask profile measure`: its arguments fail before any engine starts."""

from __future__ import annotations

import pytest

from llumdask.api.profile_cli import main


@pytest.mark.parametrize(("argv", "message"), [
    (["measure", "--out", "profile.txt"], "--out must name a .json file"),
    (["measure", "--grid", "huge"], "invalid choice: 'huge'"),
    (["measure", "--engine", "sim"], "invalid choice: 'sim'"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
