"""Ctrl-C in a follow command (``bkshell tail``) ends its loop through a flag."""

from __future__ import annotations

import os
import signal

import pytest

from bk.cli.common import until_interrupted


def test_the_first_ctrl_c_sets_the_flag_and_the_second_interrupts():
    before = signal.getsignal(signal.SIGINT)
    with until_interrupted() as stop:
        assert not stop.set
        os.kill(os.getpid(), signal.SIGINT)      # handled at the next bytecode: no exception
        for _ in range(1000):
            if stop.set:
                break
        assert stop.set
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                pass
    assert signal.getsignal(signal.SIGINT) is before
