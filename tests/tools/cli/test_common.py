"""The helpers the commands share (`sgl_vtoken_tools.cli.common`, `launcher.evict_args`,
`bench.jsonl.RunLog`): what each declares, builds and writes."""

import argparse
import json
from dataclasses import dataclass

import pytest

from sgl_vtoken_tools.bench.jsonl import RunLog
from sgl_vtoken_tools.cli import common
from sgl_vtoken_tools.launcher import evict_args


def test_numbers_declares_each_flag_with_its_default_and_type():
    p = argparse.ArgumentParser()
    common.numbers(p, sessions=8, sample_interval=0.15)
    assert vars(p.parse_args([])) == {"sessions": 8, "sample_interval": 0.15}
    args = p.parse_args(["--sessions", "3", "--sample-interval", "2"])
    assert args.sessions == 3 and args.sample_interval == 2.0
    assert isinstance(args.sessions, int) and isinstance(args.sample_interval, float)
    with pytest.raises(SystemExit):
        p.parse_args(["--sessions", "2.5"])


@dataclass(frozen=True)
class _Spec:
    sessions: int = 1
    lengths: tuple[int, ...] = (1,)
    name: str = "x"


def test_from_args_takes_the_fields_args_has_and_makes_lists_tuples():
    args = argparse.Namespace(sessions=4, lengths=[10, 20], other=1)
    assert common.from_args(_Spec, args) == _Spec(4, (10, 20), "x")
    assert common.from_args(_Spec, args, sessions=9, name="y") == _Spec(9, (10, 20), "y")


def test_cells_in_order_puts_the_reference_first_and_refuses_unknown_names():
    cells = {"stock": None, "full": ["--kv-evict", "none"]}
    args = argparse.Namespace(cells=["stock", "h=--kv-evict h2o", "full"])
    assert common.cells_in_order(args, cells, "full") == [
        ("full", ["--kv-evict", "none"]),
        ("stock", None),
        ("h", ["--kv-evict", "h2o"]),
    ]
    remote = argparse.Namespace(cells=['a={"policy": "none"}', "b"], base_url="http://x")
    assert common.cells_in_order(remote, cells) == [("a", {"policy": "none"}), ("b", None)]
    p = argparse.ArgumentParser()
    with pytest.raises(SystemExit):
        common.check_cells(p, argparse.Namespace(cells=["bogus"]), cells)


def test_evict_args_keeps_the_flag_order_and_leaves_out_what_is_not_given():
    assert evict_args("h2o", 256, 16) == [
        "--kv-evict", "h2o", "--kv-budget", "256", "--kv-evict-interval", "16"
    ]  # fmt: skip
    assert evict_args("h2o", 256, 16, sink=4, window=32, config={"recall": 8}) == [
        "--kv-evict", "h2o", "--kv-budget", "256", "--kv-sink", "4", "--kv-window", "32",
        "--kv-evict-interval", "16", "--kv-evict-config", '{"recall": 8}',
    ]  # fmt: skip
    assert evict_args("h2o", 128, config="{}") == [
        "--kv-evict", "h2o", "--kv-budget", "128", "--kv-evict-config", "{}"
    ]  # fmt: skip


def test_run_log_writes_every_line_and_echoes_it_when_asked(tmp_path, capsys):
    path = tmp_path / "run.jsonl"
    log = RunLog(path, echo=True)
    log.emit({"kind": "config"})
    log.emit({"kind": "cell", "x": 1})
    log.close()
    lines = [{"kind": "config"}, {"kind": "cell", "x": 1}]
    assert log.records == lines and common.read_lines(str(path)) == lines
    assert [json.loads(x) for x in capsys.readouterr().out.splitlines()] == lines
    quiet = RunLog(None)
    quiet.emit({"kind": "x"})
    assert quiet.records == [{"kind": "x"}] and capsys.readouterr().out == ""
