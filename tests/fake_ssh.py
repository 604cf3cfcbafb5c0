"""Stands in for the ssh client in tests (DISTNB_SSH): skips ssh's options and the host name, then
runs the remote command on this machine, as sshd would run it on the host."""

from __future__ import annotations

import os
import sys

args = sys.argv[1:]
while args and args[0].startswith("-"):
    if args.pop(0) in ("-o", "-p", "-i", "-l", "-J"):
        args.pop(0)
if len(args) < 2:
    sys.exit("fake_ssh: usage: fake_ssh [options] HOST COMMAND")
os.execv("/bin/sh", ["/bin/sh", "-c", " ".join(args[1:])])
