"""The `sluice` CLI's own behaviour (no servers): key handling and delegation to the planner."""

from __future__ import annotations

import io
import sys

from sluice_client import cli

from tests.support import REPO_ROOT


def test_a_command_without_any_api_key_exits_2_and_says_how_to_give_one(monkeypatch, capsys):
    monkeypatch.delenv("SLUICE_API_KEY", raising=False)
    assert cli.main(["runs", "get", "some-run"], out=io.StringIO()) == cli.EXIT_USAGE
    assert capsys.readouterr().err == "sluice: no API key: pass --api-key or set SLUICE_API_KEY\n"


def test_the_api_key_and_address_may_follow_the_subcommand(monkeypatch):
    monkeypatch.delenv("SLUICE_API_KEY", raising=False)
    args = cli._parser().parse_args(["runs", "tail", "r1", "--after", "35", "--api-key", "k",
                                     "--address", "127.0.0.1:1"])
    assert (args.run_id, args.after, args.api_key, args.address) == ("r1", 35, "k", "127.0.0.1:1")


def test_sluice_plan_hands_its_arguments_to_the_capacity_planner(capsys):
    brief = str(REPO_ROOT / "examples" / "briefs" / "seed003.yaml")
    code = cli.main(["plan", brief, "--json"])
    printed = capsys.readouterr().out
    assert code in (0, 1)  # the planner's verdict: meets / misses the SLO
    assert printed.lstrip().startswith("{")


def test_sluice_plan_without_the_platform_installed_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "sluice.planner.cli", None)   # as in a client-only install
    assert cli.main(["plan", "brief.yaml"]) == cli.EXIT_USAGE
    assert capsys.readouterr().err == cli.PLANNER_MISSING + "\n"
