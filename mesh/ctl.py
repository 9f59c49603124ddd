"""``python -m mesh.ctl RUN_DIR teachers {bind NAME SPEC | unbind NAME | list}``: change a live run's teachers.

```
python -m mesh.ctl runs/tiny-20261121-101500 teachers bind big '{kind: hf, path: ./teacher, use: [distill]}'
python -m mesh.ctl runs/tiny-20261121-101500 teachers unbind big
python -m mesh.ctl runs/tiny-20261121-101500 teachers list
```

SPEC is a YAML flow mapping with the fields of ``actors.teachers.bindings.config.BindingConfig``. It is
checked here before anything is sent; the run checks it again by building the binding
(loading its model) and applies it at its next step boundary, or rejects it and keeps
the old binding. Only the user who started the run can send commands (see
``mesh/supervision/commands.py``).

Exit codes: 0 applied or listed; 1 rejected by the run, or the run cannot be reached;
2 the command line or the spec is wrong (nothing was sent); 130 stopped by SIGINT.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from actors import registry
from actors.models.source import PACKAGE
from actors.teachers.bindings.config import BindingConfig
from mesh.records.layout import EVENTS, ControlError
from mesh.supervision.commands import NAME_PATTERN, read_teachers, send
from mesh.topology.schema import TopologyError, parse_yaml

EXAMPLE_SPEC = "'{kind: hf, path: ./teacher, use: [distill]}'"


class UsageError(ValueError):
    """A command line or spec that is wrong before anything is sent; exit 2."""


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.handler(args)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except ControlError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the command was withdrawn unless the run had taken it (``commands.send``)
        print(
            "stopped: SIGINT; a command the run had not taken yet was withdrawn, one it had taken is applied or "
            f"rejected all the same (see {args.run_dir / EVENTS})",
            file=sys.stderr,
        )
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mesh.ctl", description="Change a live run's teachers.")
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run directory python -m mesh.run printed")
    groups = parser.add_subparsers(dest="group", required=True, title="commands")
    teachers = groups.add_parser("teachers", help="bind, unbind or list teacher bindings")
    actions = teachers.add_subparsers(dest="action", required=True)
    waits = argparse.ArgumentParser(add_help=False)
    waits.add_argument(
        "--timeout", type=float, default=120.0, help="seconds to wait for the run's answer (default 120)"
    )
    bind = actions.add_parser("bind", parents=[waits], help="bind a teacher, or replace the one of that name")
    bind.add_argument("name", metavar="NAME", help="the binding's name: lowercase letters, digits, _ and -")
    bind.add_argument("spec", metavar="SPEC", help=f"a YAML mapping of BindingConfig fields, e.g. {EXAMPLE_SPEC}")
    bind.set_defaults(handler=_bind)
    unbind = actions.add_parser("unbind", parents=[waits], help="remove a teacher binding")
    unbind.add_argument("name", metavar="NAME")
    unbind.set_defaults(handler=_unbind)
    actions.add_parser("list", help="the bound teachers, as the run last published them").set_defaults(handler=_list)
    return parser


def _bind(args: argparse.Namespace) -> int:
    name = _check_name(args.name)
    spec = _parse_spec(args.spec)
    return _report(send(args.run_dir, "bind", {"name": name, "spec": spec}, args.timeout))


def _unbind(args: argparse.Namespace) -> int:
    return _report(send(args.run_dir, "unbind", {"name": _check_name(args.name)}, args.timeout))


def _list(args: argparse.Namespace) -> int:
    teachers = read_teachers(args.run_dir)
    if not teachers:
        print("no teachers bound")
        return 0
    rows = [("name", "kind", "use", "bound_at_step")]
    for name, entry in sorted(teachers.items()):
        spec = entry["spec"]
        use = ",".join(map(str, spec.get("use") or [])) or "-"
        rows.append((name, str(spec.get("kind", "-")), use, str(entry.get("bound_at_step", "-"))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


def _report(reply: dict) -> int:
    if reply["ok"]:
        print(reply["message"])
        return 0
    print(f"error: the run rejected the command: {reply['message']}", file=sys.stderr)
    return 1


def _check_name(name: str) -> str:
    if not NAME_PATTERN.match(name):
        raise UsageError(
            f"bad teacher name {name!r}: a name is lowercase letters, digits, _ and -, starting with a letter "
            "(e.g. big, qwen-7b)"
        )
    return name


def _parse_spec(text: str) -> dict:
    """The spec as the run will receive it, checked as far as it can be without building the binding.

    A relative ``path`` is made absolute here: the run resolves paths from its own working directory, not the
    caller's (a ``package:`` path is found the same from anywhere).
    """
    try:
        spec = parse_yaml(text, "SPEC")  # the topology file's safe, bounded reader
    except TopologyError as error:
        raise UsageError(str(error)) from None
    if not isinstance(spec, dict):
        raise UsageError(f"SPEC must be a mapping like {EXAMPLE_SPEC}, got {text!r}")
    allowed = [field.name for field in dataclasses.fields(BindingConfig)]
    unknown = [key for key in spec if key not in allowed]
    if unknown:
        raise UsageError(f"unknown key(s) {unknown} in SPEC; a teacher binding takes {allowed}")
    if "kind" not in spec:
        kinds = ", ".join(registry.BACKENDS["teacher"])
        raise UsageError(f"SPEC needs a kind: one of {kinds}, or 'package.module:Class'; e.g. {EXAMPLE_SPEC}")
    if isinstance(spec.get("path"), str) and not spec["path"].startswith(PACKAGE):
        spec["path"] = str(Path(spec["path"]).expanduser().absolute())
    try:
        BindingConfig(**spec)
    except (TypeError, ValueError) as error:
        raise UsageError(f"bad teacher spec {text}: {error}") from None
    return spec


if __name__ == "__main__":
    sys.exit(main())
