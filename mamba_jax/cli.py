"""What every command (train, data prepare, generate, serve, convert) does with a mistake in
its input or a failure it can explain: one line on stderr, `prog: message`, naming the input,
the value and the fix, and exit status 2 (as argparse's own errors), never a traceback; and
Ctrl-C, one line and status 130, as a shell reports an interrupted command. Also the
config fields --set gives (train, convert): parse_overrides.

    @command("python -m mamba_jax.train")
    def main(argv=None): ...

Inside, a check raises SystemExit("message") or lets the library's ValueError / OSError
(FileNotFoundError, a disk full, ...) through: their messages already name what is wrong.
Anything else (a bug) keeps its traceback. While a command runs, Orbax's warnings and
notices (logged through absl) are dropped: its bookkeeping, nothing the user can act on;
what matters of it (a save that failed, a checkpoint that cannot be read) the commands say
in their own lines.
"""

from __future__ import annotations

import argparse
import copy
import functools
import logging
import signal
import sys

from mamba_jax.config import Mamba2Config


class MissingDependency(ImportError):
    """An optional package an input needs (torch for a pytorch_model.bin), named with the way
    to do without it: the user's to install, not a fault of the code."""


# The library's exceptions for bad input (ValueError, which includes UnicodeDecodeError and
# json.JSONDecodeError), for files that are missing, unreadable or cannot be written, and for
# an input that needs an optional package.
USER_ERRORS = (ValueError, OSError, MissingDependency)


class UserExit(SystemExit):
    """Exit status 2 once the message is printed; str() is the message (for callers and
    tests that catch it)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.code = 2


class _WithoutOrbaxNotices(logging.Filter):
    """Drops what Orbax logs below ERROR (through absl's logger): "Attempted to create
    temporary directory ... which already exists. Removing ..." as a resumed run saves the
    step a killed one left unfinished, and the like."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not ("/orbax/" in record.pathname and record.levelno < logging.ERROR)


def command(prog: str):
    """Decorate a CLI's main(argv): SystemExit("message") and USER_ERRORS become
    `prog: message` on stderr and UserExit (status 2); Orbax's notices are dropped while
    it runs."""

    def decorate(main):
        @functools.wraps(main)
        def run(argv=None):
            quiet = _WithoutOrbaxNotices()
            logging.getLogger("absl").addFilter(quiet)
            try:
                return main(argv)
            except UserExit:
                raise
            except SystemExit as stop:
                if not isinstance(stop.code, str):  # argparse's errors, --help, exit(0)
                    raise
                message = stop.code
            except USER_ERRORS as error:
                message = str(error)
            except KeyboardInterrupt:  # Ctrl-C: the user's choice, not a failure to trace
                print(f"{prog}: interrupted", file=sys.stderr)
                raise SystemExit(128 + signal.SIGINT) from None
            finally:
                logging.getLogger("absl").removeFilter(quiet)
            print(f"{prog}: {message}", file=sys.stderr)
            raise UserExit(message)

        return run

    return decorate


def require_at_least(args: argparse.Namespace, names, least: int = 1) -> None:
    """SystemExit naming the first flag of `names` (argparse dests) whose value is below
    `least`."""
    for name in names:
        if getattr(args, name) < least:
            raise SystemExit(f"--{name.replace('_', '-')}={getattr(args, name)} must be "
                             f">= {least}")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help with each option's default, where it has one (not None; not a flag's
    True / False, which the flag's name says), options without a help text included."""

    def _format_action(self, action):
        if action.help is None and self._has_default(action):
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action):
        return super()._get_help_string(action) if self._has_default(action) else action.help

    @staticmethod
    def _has_default(action) -> bool:
        return action.default not in (None, argparse.SUPPRESS, []) \
            and not isinstance(action.default, bool)


def parse_overrides(pairs: list[str]) -> dict:
    """["mamba2.ngroups=2", "mamba2.dt_limit=0.001,0.1"] -> {"mamba2.ngroups": 2,
    "mamba2.dt_limit": (0.001, 0.1)}: names as Mamba2Config.replace takes them (a section's
    field as SECTION.FIELD, or its flat name: ngroups=2), values parsed to the field's type."""
    out = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set {pair!r}: expected FIELD=VALUE, e.g. mamba2.ngroups=2")
        try:
            default = Mamba2Config.field_default(name)
        except ValueError as error:
            raise SystemExit(f"--set {pair!r}: {error}") from None
        try:
            if isinstance(default, bool):
                if text.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(text)
                value = text.lower() in ("true", "1")
            elif isinstance(default, tuple):
                value = tuple(float(v) for v in text.strip("()[]").split(","))
            elif default is None or isinstance(default, str):
                # a field that takes a number or a word (mamba2.nheads: None or an int;
                # mamba1.dt_rank: "auto" or an int): the config checks which it takes
                value = _number_or_word(text)
            else:
                value = type(default)(text)
        except ValueError:
            raise SystemExit(f"--set {pair!r}: {text!r} is not a valid "
                             f"{type(default).__name__} for {name}") from None
        out[name] = value
    return out


def _number_or_word(text: str):
    """'8' -> 8, '0.5' -> 0.5, 'none' -> None, any other text as it is."""
    if text.lower() in ("none", "null"):
        return None
    for number in (int, float):
        try:
            return number(text)
        except ValueError:
            pass
    return text
