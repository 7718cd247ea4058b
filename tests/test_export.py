"""Hugging Face export, of each architecture of ppt/model.py that has hf_mapping() (found, not named; skipped where
none has): the folder loads in transformers with the same logits, its tokenizer adds the EOT prefix, lm-eval's own
HFLM on the export scores a local task exactly as ppt's adapter does (the parity oracle), and the import reads the
export back to the same model."""

import dataclasses
import errno
import json
import os
from pathlib import Path

import pytest
import torch
from architectures import with_hf_mapping

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
lm_eval = pytest.importorskip("lm_eval")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import ppt.model  # noqa: E402
from ppt.common import PPTError  # noqa: E402
from ppt.evals import PPTLM, demo_examples, task_manager, write_choice_task  # noqa: E402
from ppt.model_io import ModelFile, context_prefix, encoding_fingerprint, load_run  # noqa: E402
from ppt.tokenizer import train_demo_tokenizer  # noqa: E402
from scripts.export_hf import export_model, hf_state_dict  # noqa: E402

TEXT = " ".join(
    f"Paragraph {i}: a generator yields values lazily; the caller resumes it with next() until StopIteration, "
    f"and naïve code that builds lists of {i * 11} items first wastes memory."
    for i in range(40)
)


EXPORTABLE = with_hf_mapping()
pytestmark = pytest.mark.skipif(not EXPORTABLE, reason="no architecture of ppt/model.py has hf_mapping()")


def saved(model: torch.nn.Module) -> dict:
    """The config as a checkpoint holds it."""
    return {"class": type(model.config).__name__, **dataclasses.asdict(model.config)}


@pytest.fixture(scope="module", params=EXPORTABLE)
def exported(request, tmp_path_factory):
    """A randomly initialized model of the architecture (max length 48) and its export."""
    tokenizer = train_demo_tokenizer([TEXT], vocab_size=300)
    config = dataclasses.replace(ppt.model.get_config(request.param), vocab_size=tokenizer.vocab_size, max_seq_len=48)
    model = ppt.model.build_model(config)
    torch.manual_seed(0)
    model.init_weights()
    out = export_model(model.state_dict(), saved(model), tokenizer, tmp_path_factory.mktemp("export") / request.param)
    return model.eval(), tokenizer, out


def test_export_loads_in_transformers_with_the_same_logits_and_an_eot_prefixing_tokenizer(exported):
    model, tokenizer, out = exported
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(out)
    ids = hf_tokenizer.encode("a generator yields values lazily")
    assert ids == [tokenizer.eot_id, *tokenizer.backend.encode("a generator yields values lazily").ids]
    idx = torch.randint(0, tokenizer.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx), atol=1e-5, rtol=1e-5)


def test_hflm_on_the_export_matches_the_adapter(exported, tmp_path):
    """Same per-request loglikelihoods (<= 1e-4) and the same accuracy on a local multiple-choice task whose
    contexts overflow the 48-token window (both left-truncate) and on a rolling-loglikelihood task."""
    pytest.importorskip("accelerate", reason="lm-eval's HFLM needs accelerate (lm-eval's hf extra)")
    from lm_eval.models.huggingface import HFLM

    model, tokenizer, out = exported
    examples = demo_examples([TEXT], n=16, seed=2)
    assert max(len(tokenizer.backend.encode(e["context"]).ids) for e in examples) > 48, "exercise truncation"
    write_choice_task(examples, tmp_path, "parity_choice")
    data = tmp_path / "parity_rolling.jsonl"
    data.write_text("".join(json.dumps({"text": TEXT[i : i + 400]}) + "\n" for i in range(0, 1600, 400)))
    rolling = {
        "task": "parity_rolling",
        "dataset_path": "json",
        "output_type": "loglikelihood_rolling",
        "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(tmp_path / "hf_cache")},
        "test_split": "test",
        "doc_to_text": "",
        "doc_to_target": "{{text}}",
        "metric_list": [{"metric": "word_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False}],
    }
    (tmp_path / "parity_rolling.yaml").write_text(json.dumps(rolling))
    manager = task_manager([tmp_path], include_defaults=False)

    def evaluate(lm, task):
        result = lm_eval.simple_evaluate(
            model=lm, tasks=[task], task_manager=manager, bootstrap_iters=0, log_samples=True
        )
        return result["results"][task], [s["filtered_resps"] for s in result["samples"][task]]

    ours = PPTLM(model, tokenizer, device="cpu", batch_size=4)
    # add_bos_token=True: HFLM prefixes contexts with the exported BOS, which is ppt's EOT
    hflm = HFLM(pretrained=str(out), device="cpu", dtype="float32", batch_size=4, add_bos_token=True)
    ours_metrics, ours_resps = evaluate(ours, "parity_choice")
    hf_metrics, hf_resps = evaluate(hflm, "parity_choice")
    assert len(ours_resps) == 16
    for mine, theirs in zip(ours_resps, hf_resps):
        assert [lp for lp, _ in mine] == pytest.approx([lp for lp, _ in theirs], abs=1e-4)
        assert [g for _, g in mine] == [g for _, g in theirs]
    assert ours_metrics["acc,none"] == hf_metrics["acc,none"]
    assert ours_metrics["acc_norm,none"] == hf_metrics["acc_norm,none"]

    # Rolling: HFLM would tokenize the text *with* its BOS and then also prepend the prefix token, scoring the BOS
    # itself; without add_bos_token it scores EOT + text exactly as the adapter does.
    hflm_rolling = HFLM(pretrained=str(out), device="cpu", dtype="float32", batch_size=4, add_bos_token=False)
    _, ours_rolling = evaluate(ours, "parity_rolling")
    _, hf_rolling = evaluate(hflm_rolling, "parity_rolling")
    assert [r[0] for r in ours_rolling] == pytest.approx([r[0] for r in hf_rolling], abs=1e-4)


def test_the_import_reads_the_export_back_to_the_same_model_and_tokenizer(exported):
    model, tokenizer, out = exported
    if not hasattr(ppt.model, "config_from_hf"):
        pytest.skip("ppt/model.py has no config_from_hf(): it imports no Hugging Face folders")
    run = load_run(hf_dir=out, model_file=ModelFile.of(ppt.model))
    assert run.config == saved(model)
    assert run.state["model"].keys() == model.state_dict().keys()
    assert all(torch.equal(run.state["model"][k], v) for k, v in model.state_dict().items())
    # the export's tokenizer adds EOT as BOS, which ppt does itself: the same tokenizer for ppt's purposes, and the
    # import scores its contexts after that EOT, as ppt scores the run it came from
    assert run.state["tokenizer_fingerprint"] == encoding_fingerprint(tokenizer)
    assert context_prefix(run, tokenizer) == [tokenizer.eot_id]


def test_a_read_only_folder_and_a_full_disk_stop_with_one_line_and_leave_nothing(exported, tmp_path, monkeypatch):
    import tempfile

    import safetensors.torch
    from safetensors import SafetensorError

    model, tokenizer, _ = exported
    llama = {"class": "LlamaConfig", **dataclasses.asdict(model.config)}

    def read_only(*args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    with monkeypatch.context() as m:
        m.setattr(tempfile, "mkdtemp", read_only)
        with pytest.raises(PPTError, match=r"cannot write into .* \(Permission denied\); pass another --out$"):
            export_model(model.state_dict(), llama, tokenizer, tmp_path / "out")
    written = []

    def full_disk(tensors, path, metadata=None):  # what safetensors raises when the disk fills
        written.append(path)
        Path(path).write_bytes(b"part of a file")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(PPTError, match=r"could not write the export into .*No space left on device.*; free disk space"):
        export_model(model.state_dict(), llama, tokenizer, tmp_path / "out")
    assert written and not list(tmp_path.iterdir()), "no folder, no staging folder left"


def test_export_refuses_unknown_weights_and_existing_folders(exported, tmp_path):
    """(An architecture without hf_mapping() is refused in tests/test_third_architecture.py.)"""
    model, tokenizer, out = exported
    with pytest.raises(PPTError, match="not those ppt/model.py's hf_mapping\\(\\) names.*blocks.0.attn.gate.weight"):
        hf_state_dict({"blocks.0.attn.gate.weight": torch.zeros(2)}, {"embed.weight": "model.embed_tokens.weight"})
    again = export_model(model.state_dict(), saved(model), tokenizer, tmp_path / "again")
    with pytest.raises(PPTError, match="exists and is not empty"):
        export_model(model.state_dict(), saved(model), tokenizer, again)
    export_model(model.state_dict(), saved(model), tokenizer, again, dtype=torch.bfloat16, overwrite=True)
    assert json.loads((again / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again"], "no staging folder left behind"


def test_export_refuses_a_file_and_force_replaces_only_an_earlier_export(exported, tmp_path):
    model, tokenizer, _ = exported
    export = lambda out, overwrite=False: export_model(
        model.state_dict(), saved(model), tokenizer, out, overwrite=overwrite
    )
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    with pytest.raises(PPTError, match="notes.txt is a file, not a folder"):
        export(a_file)
    with pytest.raises(PPTError, match="cannot write into .*notes.txt"):
        export(a_file / "sub")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("data")
    with pytest.raises(PPTError, match="corpus is not an earlier export \\(it holds a.txt\\)"):
        export(corpus, overwrite=True)
    # an earlier export with a file of the user's added: not replaced either
    earlier = export(tmp_path / "earlier")
    (earlier / "README.md").write_text("my notes")
    with pytest.raises(PPTError, match="not an earlier export \\(it holds README.md\\)"):
        export(earlier, overwrite=True)
    assert a_file.read_text() == "mine" and (corpus / "a.txt").exists() and (earlier / "README.md").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "earlier", "notes.txt"], "no staging folder left"
