"""Ctrl-C during `mosaic generate` ends with one line and exit code 130, the engine closed."""

from mosaic import MosaicEngine
from mosaic.cli import main
from mosaic.engine.steps import Executor


def test_ctrl_c_inside_the_step_program_is_one_line_and_130(monkeypatch, capsys):
    closed = []

    def interrupted(self, *a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(Executor, "execute", interrupted)      # inside the denoising loop
    real_close = MosaicEngine.close
    monkeypatch.setattr(MosaicEngine, "close", lambda self: (closed.append(1), real_close(self)))
    assert main(["generate", "--prompt", "sort 907=", "--no-progress"]) == 130
    err = capsys.readouterr().err
    assert err == "interrupted\n" and closed
