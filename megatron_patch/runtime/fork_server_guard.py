"""Imported first by every fork server this project starts (``launch._start_context``): the server ends when the
process that started it ends. multiprocessing's server stays up while any process holds its "alive" pipe, and
each process forked from it holds one, while each rank forked from it is armed to end with it: without this, a
launcher killed alone (the kernel's OOM killer picks one process) left its server and ranks waiting for each other
for good. A launcher gone before this runs is caught by that pipe: nothing forked holds it yet."""

import os
import signal

# Ctrl-C reaches the whole process group, this server too, and the process that started it handles it (ending the
# server). Ignored while the preload imports torch and megatron-core, which printed a page of KeyboardInterrupt
# traceback around that process's one line; ``fork_server_ready``, imported last, puts it back before multiprocessing
# saves the handlers the processes it forks get.
SIGINT_BEFORE = signal.signal(signal.SIGINT, signal.SIG_IGN)

try:
    from megatron_patch.runtime.launch import die_with_parent

    die_with_parent(os.getppid(), "the process that started it")
except Exception:  # noqa: BLE001 - as rank_preload: the server must start; die_with_parent has a fallback of its own
    pass
