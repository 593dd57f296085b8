import subprocess
import sys

from deploy.cli import COMMANDS, main


def test_only_built_subcommands_exist(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out
    assert main(["no-such-command"]) == 2


def test_console_script_help_runs_without_loading_torch():
    code = ("import sys; from deploy.cli import main; main(['--help']); "
            "assert 'torch' not in sys.modules, 'the CLI imported torch eagerly'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "serve" in r.stdout


def test_serve_rejects_bad_settings_with_the_flag_name():
    r = subprocess.run([sys.executable, "-m", "deploy.cli", "serve", "--page-size", "3"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "--page-size" in r.stderr and "power of two" in r.stderr


COMMAND_LINES = [["serve"], ["prefill"], ["decode"], ["router"], ["cluster"], ["convert"]] + [
    ["bench", b]
    for b in ("engine", "transfer", "router", "serve", "compare", "chaos", "kv_routing", "retract")]


def test_every_flag_of_every_command_has_help_and_shows_its_default(monkeypatch):
    import argparse

    import pytest

    seen: list[argparse.ArgumentParser] = []

    def record(parser, file=None):
        seen.append(parser)

    monkeypatch.setattr(argparse.ArgumentParser, "print_help", record)
    for argv in COMMAND_LINES:
        seen.clear()
        with pytest.raises(SystemExit):
            main(argv + ["--help"])
        assert seen, argv
        parser = seen[-1]
        assert issubclass(parser.formatter_class, argparse.ArgumentDefaultsHelpFormatter), argv
        bare = [a.option_strings or a.dest for a in parser._actions if not (a.help or "").strip()]
        assert not bare, (argv, bare)


def test_version(capsys):
    from importlib.metadata import version

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"pdserve {version('pdserve')}"
