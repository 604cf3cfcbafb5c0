"""A notebook stand-in for the network tests: an IPython shell with distnb loaded that runs the cells
it reads on stdin (each ended by a line ``\\0END``) and prints ``\\0DONE ok|error`` after each, all
output (the magics' live printing included) on stdout. Run inside a test host's namespace, so the
controller is on that host, exactly as a notebook there would be."""

from __future__ import annotations

import sys

from IPython.core.interactiveshell import InteractiveShell


def main() -> None:
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "distnb")
    lines: list[str] = []
    print("\0READY", flush=True)
    for line in sys.stdin:
        if line.rstrip("\n") != "\0END":
            lines.append(line)
            continue
        result = shell.run_cell("".join(lines), store_history=True)
        lines = []
        sys.stderr.flush()
        print(f"\0DONE {'ok' if result.success else 'error'}", flush=True)


if __name__ == "__main__":
    main()
