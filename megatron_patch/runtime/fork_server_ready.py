"""Imported last by every fork server this project starts (``launch._start_context``): SIGINT as it was before
``fork_server_guard`` ignored it for the preload, so that what the server forks handles Ctrl-C as usual."""

import signal

from megatron_patch.runtime.fork_server_guard import SIGINT_BEFORE

signal.signal(signal.SIGINT, signal.SIG_DFL if SIGINT_BEFORE is None else SIGINT_BEFORE)
