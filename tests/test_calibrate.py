"""`kvbench calibrate` as a whole: each window starts as its policy's prompts start (the start token, or KVzap's chat
turn) and its provenance says so; the per-model cache keyed by the calibration format, a stale entry recomputed
and said; an output folder that cannot be written is one line, exit 2, with nothing written."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from tokenizers import processors
from typer.testing import CliRunner

from kvbench.calibration import artifacts, calibrate
from kvbench.calibration.calibrate import corpus_documents, window_start
from kvbench.calibration.methods import METHODS, Settings
from kvbench.cli import app
from kvbench.engine.models import _PER_MODEL, byte_tokenizer, load_model
from kvbench.errors import KvbenchError

SETTINGS = Settings(documents=2, tokens=40, samples=40)
TEMPLATE = ("{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def starting_with_bos():
    """The random models' byte tokenizer, adding `<s>` (id 257) before every text, as Llama's and Gemma's add BOS."""
    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens({"bos_token": "<s>"})
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)])
    return tokenizer


def chatting():
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def bos_llama():
    lm = load_model("random:tiny-llama", dtype="float32", device="cpu", seed=21)
    return dataclasses.replace(lm, tokenizer=starting_with_bos())


@pytest.mark.parametrize("method", METHODS)
def test_on_a_tokenizer_that_adds_bos_every_window_starts_with_it(bos_llama, method):
    documents = corpus_documents(bos_llama, "embedded", SETTINGS, method)
    assert len(documents) == 2 and all(len(ids) == SETTINGS.tokens for ids in documents)
    assert all(ids[0] == 257 and 257 not in ids[1:] for ids in documents)
    assert window_start(bos_llama.tokenizer, method) == ([257], "start token")


def test_kvzaps_windows_open_a_chat_turn_where_the_tokenizer_has_a_template_and_the_others_do_not():
    tokenizer = chatting()
    opening, how = window_start(tokenizer, "kvzap-mlp")
    assert (tokenizer.decode(opening), how) == ("<|user|>", "chat template")
    assert window_start(tokenizer, "qfilter") == window_start(tokenizer, "expected-attention") == ([], "none")
    assert window_start(byte_tokenizer(), "kvzap-linear") == ([], "none")  # no template: the raw text, as others


def test_the_provenance_says_how_the_windows_start(bos_llama, cache, tmp_path):
    done = calibrate.calibrate(bos_llama, "qfilter", "embedded", SETTINGS, tmp_path / "out")
    provenance = json.loads((done.folder / artifacts.PROVENANCE_FILE).read_text())
    assert {key: provenance[key] for key in ("window_start", "window_start_tokens", "window_start_text",
                                             "calibration_format")} == {
        "window_start": "start token", "window_start_tokens": 1, "window_start_text": "<s>",
        "calibration_format": calibrate.CALIBRATION_FORMAT}


def test_a_kvzap_calibration_skips_the_chat_turns_opening(cache, tmp_path, monkeypatch):
    from kvbench.calibration import kvzap

    lm = dataclasses.replace(load_model("random:tiny-llama", dtype="float32", device="cpu", seed=22),
                             tokenizer=chatting())
    skipped = []
    fit = kvzap.fit
    monkeypatch.setattr(kvzap, "fit", lambda *args, skip=0: skipped.append(skip) or fit(*args, skip=skip))
    settings = Settings(documents=3, tokens=48, samples=100, held_out=1, hidden_dim=8, epochs=1)
    assert calibrate.calibrate(lm, "kvzap-linear", "embedded", settings, tmp_path / "out").computed
    assert skipped == [len("<|user|>")]


def test_kvzap_fits_and_scores_only_the_positions_after_what_it_skips(sharp_llama):
    """The opening runs through the model (its targets cover the whole window) but is neither trained on nor
    scored, as kvpress's collector samples only the text's positions: the same ridge and held-out R^2 as from the
    text's positions alone."""
    from kvbench.calibration import kvzap

    settings, skip = Settings(documents=3, tokens=48, samples=48, held_out=1), 8
    documents = corpus_documents(sharp_llama, "embedded", settings, "kvzap-linear")
    saved = kvzap.fit(sharp_llama, documents, settings, "linear", lambda done, total: None, skip=skip)
    data = [tuple(values[:, skip:] for values in kvzap.targets(sharp_llama, ids)) for ids in documents]
    ridge = kvzap._RidgeSums(sharp_llama.num_layers)
    for features, scores in data[:2]:
        ridge.add(features, scores)
    expected = ridge.solve()
    for name, tensor in expected.state_dict().items():
        torch.testing.assert_close(saved[kvzap.WEIGHTS + name], tensor, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(saved["r2"], kvzap.evaluate(expected, data[2:])[0], rtol=1e-4, atol=1e-5)


def test_a_calibration_of_another_format_is_recomputed_and_says_so(sharp_llama, cache, tmp_path, monkeypatch):
    notices: list[str] = []
    first = calibrate.calibrate(sharp_llama, "qfilter", "embedded", SETTINGS, tmp_path / "a", notice=notices.append)
    assert first.computed and first.stale is None and not notices
    _PER_MODEL.clear()  # a new process
    again = calibrate.calibrate(sharp_llama, "qfilter", "embedded", SETTINGS, tmp_path / "a", notice=notices.append)
    assert not again.computed and not notices  # read back: the same format
    monkeypatch.setattr(calibrate, "CALIBRATION_FORMAT", calibrate.CALIBRATION_FORMAT + 1)
    forwards = []
    handle = sharp_llama.model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        newer = calibrate.calibrate(sharp_llama, "qfilter", "embedded", SETTINGS, tmp_path / "a",
                                    notice=notices.append)
    finally:
        handle.remove()
    assert newer.computed and newer.stale == calibrate.CALIBRATION_FORMAT - 1 and len(forwards) == SETTINGS.documents
    assert len(notices) == 1 and "\n" not in notices[0]
    assert f"format {calibrate.CALIBRATION_FORMAT - 1}" in notices[0] and "recomputing" in notices[0]
    provenance = json.loads((tmp_path / "a" / artifacts.PROVENANCE_FILE).read_text())
    assert provenance["calibration_format"] == calibrate.CALIBRATION_FORMAT
    _PER_MODEL.clear()
    assert not calibrate.calibrate(sharp_llama, "qfilter", "embedded", SETTINGS, tmp_path / "a").computed
    assert len(list((cache / "calibrate-qfilter").glob("*.pt"))) == 1  # replaced, not beside


def test_a_calibration_cached_before_formats_were_kept_is_recomputed(sharp_llama, cache, tmp_path):
    calibrate.calibrate(sharp_llama, "qfilter", "embedded", SETTINGS, tmp_path / "a")
    (entry,) = (cache / "calibrate-qfilter").glob("*.pt")
    saved = torch.load(entry)
    del saved["__kvbench_version__"]
    torch.save(saved, entry)  # as kvbench wrote them before
    _PER_MODEL.clear()
    notices: list[str] = []
    done = calibrate.calibrate(sharp_llama, "qfilter", "embedded", SETTINGS, tmp_path / "a", notice=notices.append)
    assert done.computed and done.stale == 0 and "format 0" in notices[0]


@pytest.mark.parametrize("where", ["file above", "file there", "read-only"])
def test_an_output_folder_that_cannot_be_made_is_one_line_exit_2_and_nothing_written(cache, tmp_path, where):
    blocker = tmp_path / "a-file"
    blocker.write_text("in the way\n")
    output = {"file above": blocker / "filters", "file there": blocker, "read-only": Path("/proc/kvbench/filters")}[
        where]
    result = CliRunner().invoke(app, ["calibrate", "-m", "random:tiny-llama", "--method", "qfilter", "-o",
                                      str(output), "--documents", "1", "--tokens", "32"])
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output, result.output
    assert str(output if where != "file there" else blocker) in result.output.replace("\n", "")
    assert not (cache / "calibrate-qfilter").exists() and blocker.read_text() == "in the way\n"


def test_a_write_that_fails_midway_leaves_no_part_of_an_artifact(tmp_path, monkeypatch):
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(artifacts, "save_file", full_disk)
    with pytest.raises(KvbenchError, match="cannot write the folder .*: No space left on device"):
        calibrate.save_qfilters(torch.zeros(2, 2, 16), tmp_path / "filters", {})
    assert list(tmp_path.iterdir()) == []
