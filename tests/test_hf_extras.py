"""The interop's optional packages (the ``hf`` extra): without them, the flag that needs one says in one line
which extra to install, before anything runs."""
import importlib.util
from types import SimpleNamespace

import pytest

from zerompi.data.prepare import prepare
from zerompi.errors import ConfigError
from zerompi.train.tensorboard import check_config


@pytest.fixture
def missing(monkeypatch):
    """importlib.util.find_spec finds neither tensorboardX nor tokenizers."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("tensorboardX", "tokenizers") else real(name, *a))


def test_missing_extras_are_one_line(missing, tmp_path):
    needs = r"tensorboard='tb' needs the tensorboardX package; pip install 'zerompi\[hf\]'"
    with pytest.raises(ConfigError, match=needs):
        check_config(SimpleNamespace(tensorboard="tb"))
    (tmp_path / "t.txt").write_text("text\n")
    with pytest.raises(ConfigError, match=r"prepare needs the tokenizers package; pip install 'zerompi\[hf\]'"):
        prepare(str(tmp_path / "t.txt"), str(tmp_path / "out.bin"))
    assert not (tmp_path / "out.bin").exists()
