import pytest
import torch

from ppt import checkpoint as ckpt
from ppt.common import PPTError


def payload(value: float) -> dict:
    return {"model": {"w": torch.full((3,), value)}, "config": {"class": "C", "a": 1}, "rng": ckpt.rng_state()}


def test_save_load_round_trip_and_latest(tmp_path):
    for step in (10, 20, 30):
        ckpt.save_checkpoint(tmp_path, step, payload(step))
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [10, 20, 30]
    latest = ckpt.latest_checkpoint(tmp_path)
    state = ckpt.load_checkpoint(latest)
    assert state["step"] == 30 and torch.equal(state["model"]["w"], torch.full((3,), 30.0))


def test_keep_prunes_only_after_the_new_file_is_complete(tmp_path):
    for step in range(1, 6):
        ckpt.save_checkpoint(tmp_path, step, payload(step), keep=2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [4, 5]


def test_latest_skips_partial_and_corrupt_files(tmp_path):
    ckpt.save_checkpoint(tmp_path, 1, payload(1.0))
    good = ckpt.save_checkpoint(tmp_path, 2, payload(2.0))
    (tmp_path / ".step_00000003.pt.123.tmp").write_bytes(b"half a file")  # a kill mid-write
    ckpt.checkpoint_path(tmp_path, 4).write_bytes(good.read_bytes()[:100])  # truncated by a full disk
    assert ckpt.latest_checkpoint(tmp_path) == good


def test_load_refuses_code_objects(tmp_path):
    path = tmp_path / "step_00000001.pt"
    torch.save({"model": {}, "evil": print}, path)  # a pickled callable must not be loaded
    with pytest.raises(PPTError, match="holds Python objects other than tensors.*could run code"):
        ckpt.load_checkpoint(path)
    with pytest.raises(PPTError, match="does not exist"):
        ckpt.load_checkpoint(tmp_path / "missing.pt")


def test_load_tells_a_file_that_is_no_checkpoint_from_a_damaged_one(tmp_path):
    """A file of another kind is not a checkpoint (nothing to delete); a cut one is, and --resume auto skips it."""
    notes = tmp_path / "notes.txt"
    notes.write_text("not a checkpoint")
    with pytest.raises(PPTError, match=r"notes\.txt is not a checkpoint \(not a PyTorch archive\); pass a step_\*\.pt"):
        ckpt.load_checkpoint(notes)
    cut = ckpt.save_checkpoint(tmp_path, 1, payload(1.0))
    cut.write_bytes(cut.read_bytes()[:300])
    with pytest.raises(PPTError, match=r"unreadable or incomplete .*--resume auto picks the newest complete"):
        ckpt.load_checkpoint(cut)


def test_rng_round_trip():
    state = ckpt.rng_state()
    a = torch.rand(4)
    ckpt.set_rng_state(state)
    assert torch.equal(torch.rand(4), a)


def test_config_mismatch_names_fields():
    diff = ckpt.config_mismatch({"class": "Llama", "n_layer": 4, "d": 8}, {"class": "Llama", "n_layer": 6, "d": 8})
    assert diff == ["n_layer: checkpoint=4 run=6"]


def test_unwritable_output_dir_fails_early(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(PPTError, match="not writable"):
        ckpt.ensure_writable(blocker / "sub", 10)
    with pytest.raises(PPTError, match=r"B free under .*; a checkpoint takes about 1000000\.0 TB"):
        ckpt.ensure_writable(tmp_path, 10**18)
