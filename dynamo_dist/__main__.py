"""``python -m dynamo_dist explain [--json PATH] script.py [script args]``

Runs ``script.py`` as ``__main__`` with every ``torch.compile(..., backend="dist")`` in it
recorded, then prints what Dynamo and the ``dist`` backend did: graphs (ops, input placements,
collective ledger), graph breaks at the script's file:line with hints, recompilations.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys

from .diagnose import recording


def explain_script(script: str, args: list[str], json_path: str | None = None,
                   inductor: bool = True) -> int:
    """Run ``script`` with ``args`` under ``recording()``, print the report (and write it as JSON
    to ``json_path``). Returns the exit status: the script's own (0 if it ran to the end), 1 if
    it raised. Raises FileNotFoundError if ``script`` does not exist."""
    from rich.console import Console


    if not os.path.isfile(script):
        raise FileNotFoundError(script)
    status = 0
    argv, path0 = sys.argv, sys.path[0]
    sys.argv, sys.path[0] = [script, *args], os.path.dirname(os.path.abspath(script))
    with recording(None if inductor else {"inductor": False}) as rec:
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except Exception as e:  # reported with the user's file:line, then a non-zero status
            rec.error, status = e, 1
        finally:
            sys.argv, sys.path[0] = argv, path0
    report = rec.report()
    console = Console() if sys.stdout.isatty() else Console(width=160)
    report.print(console)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report.to_dict(), f, indent=2, default=str)
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dynamo_dist",
                                     description="dynamo_dist command-line tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("explain", help="run a script and explain its dist compilations",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    p.add_argument("--no-inductor", action="store_true",
                   help="run the local graphs as FX graphs (backend option inductor=False)")
    p.add_argument("script", help="the Python script to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    ns = parser.parse_args(argv)
    if ns.command == "explain":
        try:
            return explain_script(ns.script, ns.args, ns.json, inductor=not ns.no_inductor)
        except FileNotFoundError as e:
            parser.error(f"no such script: {e}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
