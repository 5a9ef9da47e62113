"""Fixtures of the patches tests."""

import pytest

from sgl_vtoken.config import ENV_VAR


@pytest.fixture
def parse(monkeypatch, tiny_model):
    """SGLang's `prepare_server_args` with the plugin's hooks applied, as in the launcher (the
    tiny model unless the flags name another `--model-path`)."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    monkeypatch.delenv(ENV_VAR, raising=False)

    def run(*flags):
        return prepare_server_args(["--model-path", str(tiny_model), *flags])

    return run


@pytest.fixture
def refused(parse, capsys):
    """`refused(*flags)`: what SGLang's parser writes to stderr when it refuses the flags, after
    checking it exits with status 2 (an argument error)."""

    def run(*flags):
        with pytest.raises(SystemExit) as e:
            parse(*flags)
        assert e.value.code == 2
        return capsys.readouterr().err

    return run
