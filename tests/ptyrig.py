"""A program on a real pseudo-terminal, as a person runs it: keys go in, the screen's bytes come out,
and ``expect`` waits (bounded) for text to appear. The standard library's ``pty`` only: pexpect is not
a dependency."""

from __future__ import annotations

import os
import re
import select  # poll, not select(): a test process may hold more than select()'s 1,024 descriptors
import signal
import struct
import subprocess
import termios
import time
from fcntl import ioctl

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")


class PtySession:
    def __init__(self, argv: list[str], env: dict, rows: int = 30, cols: int = 200) -> None:
        self.master, slave = os.openpty()
        ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        self.proc = subprocess.Popen(argv, env={**env, "TERM": "xterm"}, stdin=slave, stdout=slave, stderr=slave,
                                     start_new_session=True, close_fds=True)
        os.close(slave)
        self.raw = ""  # everything the program wrote
        self._seen = 0  # where the next expect starts looking

    def send(self, text: str) -> None:
        os.write(self.master, text.encode())

    def _read(self, timeout: float) -> None:
        poller = select.poll()
        poller.register(self.master, select.POLLIN)
        if poller.poll(timeout * 1000):
            try:
                self.raw += os.read(self.master, 65536).decode("utf-8", "replace")
            except OSError:  # the program ended and closed the terminal
                pass

    def expect(self, text: str, timeout: float) -> str:
        """Wait until ``text`` appears (ANSI codes left out) after what the last expect matched; the
        screen so far."""
        return self._wait_for([text], timeout, f"{text!r}")[1]

    def expect_first(self, texts: list[str], timeout: float) -> str:
        """Wait until one of ``texts`` appears after what the last expect matched; the first to appear."""
        return self._wait_for(texts, timeout, f"none of {texts!r}")[0]

    def _wait_for(self, texts: list[str], timeout: float, what: str) -> tuple[str, str]:
        """The earliest of ``texts`` shown after the last match, and the screen (ANSI codes left out)."""
        deadline = time.monotonic() + timeout
        while True:
            plain = ANSI.sub("", self.raw)
            found = [(at, t) for t in texts if (at := plain.find(t, self._seen)) >= 0]
            if found:
                at, text = min(found)
                self._seen = at + len(text)
                return text, plain
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} not shown within {timeout} s; the screen ended with:\n"
                                     f"{plain[-3000:]}")
            self._read(0.2)

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self._read(0.2)
        return self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        os.close(self.master)
