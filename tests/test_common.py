import pytest
import torch

from ppt import common


def test_dtype_autodetect_and_override(monkeypatch):
    monkeypatch.delenv("PPT_DTYPE", raising=False)
    assert common.autodetect_dtype(torch.device("cpu")) == torch.float32
    monkeypatch.setenv("PPT_DTYPE", "bf16")
    assert common.autodetect_dtype(torch.device("cpu")) == torch.bfloat16
    monkeypatch.setenv("PPT_DTYPE", "int3")
    with pytest.raises(common.PPTError, match="PPT_DTYPE"):
        common.autodetect_dtype(torch.device("cpu"))


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("PPT_CACHE", str(tmp_path))
    assert common.cache_dir() == tmp_path
    monkeypatch.delenv("PPT_CACHE")
    assert common.cache_dir().parts[-2:] == (".cache", "ppt")


def test_single_process_runtime(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    rt = common.init_runtime("cpu")
    assert (rt.rank, rt.world_size, rt.is_master, rt.distributed) == (0, 1, True, False)
    assert rt.device.type == "cpu"


def test_print0_is_silent_off_rank_zero(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    common.print0("hidden")
    monkeypatch.setenv("RANK", "0")
    common.print0("shown")
    assert capsys.readouterr().out == "shown\n"
