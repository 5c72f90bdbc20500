"""Help texts: every command's --help exits 0 and says what is true.

`specserve --help` names every benchmark, `specserve bench --help` lists them with what each
measures, and each benchmark, `train-draft` and the server take --help.
"""
from __future__ import annotations


def _exit_code(fn, argv) -> int:
    try:
        return fn(argv)
    except SystemExit as e:  # argparse's --help
        return e.code or 0


def test_every_help_exits_0(capsys):
    from specserve import cli, launch_server
    from specserve.bench import cli as bench_cli
    from specserve.train import cli as train_cli

    assert _exit_code(cli.main, ["--help"]) == 0
    top = capsys.readouterr().out
    assert all(name in top for name in bench_cli.BENCHES), "specserve --help names every benchmark"
    assert _exit_code(bench_cli.main, ["--help"]) == 0
    listing = capsys.readouterr().out
    assert all(f"  {name} " in listing for name in bench_cli.BENCHES)
    for name in bench_cli.BENCHES:
        assert _exit_code(bench_cli.main, [name, "--help"]) == 0, name
    assert _exit_code(train_cli.main, ["--help"]) == 0
    assert _exit_code(launch_server.main, ["--help"]) == 0
    assert _exit_code(cli.main, ["serve", "--help"]) == 0
    assert _exit_code(cli.main, []) == 2 and _exit_code(bench_cli.main, []) == 2
    assert _exit_code(bench_cli.main, ["no-such-bench"]) == 2


def test_the_draft_path_help_says_when_it_may_be_omitted():
    from specserve.args import build_parser

    action = next(a for a in build_parser()._actions if a.dest == "speculative_draft_model_path")
    assert "Required for STANDALONE" in action.help
    assert "EAGLE3 may omit it" in action.help and "shipped head" in action.help
