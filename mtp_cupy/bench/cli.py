"""The command-line conventions of scripts/: every flag's help names its default, a bad argument is one line
on stderr and exit status 2 (no traceback), and an mtp_cupy error (no CUDA device, a bad checkpoint) is one
line and exit status 1."""
from __future__ import annotations

import argparse
import sys

from ..errors import MtpError


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's layout; adds "(default: X)" to a flag's help unless it says so itself."""

    def _get_help_string(self, action):
        h = action.help or ""
        if "%(default)" in h or "default" in h or not action.option_strings or action.default is argparse.SUPPRESS:
            return h
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            return h + " (default: off)" if action.default is False else h + " (default: on)"
        if action.default is None:
            return h + " (default: none)"
        return h + " (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser of the scripts: docstring as description, defaults in the help, one-line errors.

    Parameters
    ----------
    doc : str
        The script's module docstring: its first paragraph is the description, the rest the epilog.
    **kw
        Passed to ``argparse.ArgumentParser``.
    """

    def __init__(self, doc: str, **kw):
        first, _, rest = (doc or "").strip().partition("\n\n")
        super().__init__(description=first, epilog=rest or None, formatter_class=_Formatter, **kw)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _int_from(s: str, lo: int) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a whole number") from None
    if v < lo:
        raise argparse.ArgumentTypeError(f"{v} is not positive" if lo == 1 else f"{v} is negative")
    return v


def positive_int(s: str) -> int:
    """An int >= 1 (argparse type)."""
    return _int_from(s, 1)


def nonneg_int(s: str) -> int:
    """An int >= 0 (argparse type)."""
    return _int_from(s, 0)


def int_list(s: str) -> list[int]:
    """A comma list of positive ints, "1,2,3" (argparse type)."""
    out = [positive_int(x) for x in s.replace(" ", "").split(",") if x]
    if not out:
        raise argparse.ArgumentTypeError(f"{s!r} holds no number")
    return out


def device_flags(p: argparse.ArgumentParser, default: str = "cuda", tiny: bool = True) -> None:
    """Add the flags every real-dims script has: --seed, --device and (with `tiny`) --tiny."""
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs")
    p.add_argument("--device", choices=["auto", "cuda", "ref"], default=default,
                   help="cuda, the NumPy device (ref: wall clock only), or cuda when there is one (auto)")
    if tiny:
        p.add_argument("--tiny", action="store_true", help="tiny dims (a smoke run of this script)")


def run_main(main, prog: str | None = None) -> None:
    """Call ``main()`` and exit with its return value; an `MtpError` becomes one line and exit status 1.

    Parameters
    ----------
    main : callable
        The script's main; returns None or an exit status.
    prog : str, optional
        The name in the error line (default: the script's file name).
    """
    try:
        rc = main()
    except MtpError as e:
        name = prog or (sys.argv[0].rsplit("/", 1)[-1] if sys.argv and sys.argv[0] else "mtp_cupy")
        sys.stderr.write(f"{name}: error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}\n")
        sys.exit(1)
    sys.exit(rc or 0)
