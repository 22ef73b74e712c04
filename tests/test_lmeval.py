"""The lm-eval bridge: requests really go through the compressed cache; lm-eval tasks as sweep cells, offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from kvbench.policies import build_policy  # noqa: E402
from kvbench.tasks.lmeval_model import KvbenchLM  # noqa: E402
from tests.conftest import needs_embedded, random_ids  # noqa: E402
from tests.helpers import model_approx  # noqa: E402

QA = [{"question": "The capital of France is", "answer": "Paris"},
      {"question": "Two plus two is", "answer": "four"},
      {"question": "The colour of a clear sky is", "answer": "blue"}]
MC = [{"question": "The capital of France is", "choices": ["Paris", "Rome", "Oslo"], "label": 0},
      {"question": "Two plus two is", "choices": ["three", "four", "five"], "label": 1}]


def local_tasks(folder) -> str:
    """Two lm-eval tasks on local JSON files: one `generate_until`, one `multiple_choice`."""
    for name, rows in (("qa", QA), ("mc", MC)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = "dataset_path: json\ntest_split: test\nmetadata:\n  version: 1.0\n"
    (folder / "local_qa.yaml").write_text(
        f"task: local_qa\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'qa.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 6\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")
    (folder / "local_mc.yaml").write_text(
        f"task: local_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: label\nmetric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    return str(folder)


class Request:
    """What lm-eval hands a model: `args`, and the doc it belongs to."""

    def __init__(self, *args) -> None:
        self.args, self.task_name, self.doc_id = args, "test", 0


@pytest.mark.parametrize("policy", ["window", "h2o", "snapkv"])
def test_a_small_budget_changes_the_loglikelihood_and_a_roomy_one_does_not(sharp_llama, policy):
    """The point of the bridge: the continuation is scored through the compressed cache."""
    tokenizer = sharp_llama.tokenizer
    context = tokenizer.decode(random_ids(150, seed=1, vocab=200) + [32])
    request = Request(context, " the end of it")

    def loglikelihood(name, budget):
        model = KvbenchLM(pretrained=sharp_llama, policy=build_policy(name) if budget else build_policy("full"),
                          budget=budget)
        (logprob, greedy), = model.loglikelihood([request])
        return logprob, model.measurements[0]

    full, _ = loglikelihood("full", None)
    small, measured = loglikelihood(policy, 40)
    roomy, _ = loglikelihood(policy, 400)
    assert measured["evictions"] > 0 and measured["cache_ratio"] < 0.5 and measured["doc_id"] == 0
    assert abs(small - full) > 1e-3
    assert roomy == model_approx(sharp_llama, full)


def test_the_full_cache_scores_as_lm_evals_own_model(tiny_llama):
    from lm_eval.models.huggingface import HFLM

    context = tiny_llama.tokenizer.decode(random_ids(80, seed=2, vocab=200))
    requests = [Request(context, " a b c"), Request(context, " x")]
    ours = KvbenchLM(pretrained=tiny_llama).loglikelihood(requests)
    stock = HFLM(pretrained=tiny_llama.model, tokenizer=tiny_llama.tokenizer, backend="causal", batch_size=1)
    tiny_llama.model.set_attn_implementation("sdpa")
    try:
        theirs = stock.loglikelihood(requests, disable_tqdm=True)
    finally:
        tiny_llama.model.set_attn_implementation("kvbench")
    for (a, greedy_a), (b, greedy_b) in zip(ours, theirs, strict=True):
        assert a == model_approx(tiny_llama, b) and greedy_a == greedy_b


def test_rolling_loglikelihood_streams_through_the_cache(tiny_llama):
    text = tiny_llama.tokenizer.decode(random_ids(200, seed=3, vocab=200))
    full = KvbenchLM(pretrained=tiny_llama, stream_chunk=32).loglikelihood_rolling([Request(text)])[0]
    model = KvbenchLM(pretrained=tiny_llama, policy=build_policy("window"), budget=48, stream_chunk=32)
    windowed = model.loglikelihood_rolling([Request(text)])[0]
    assert windowed != model_approx(tiny_llama, full)
    assert model.measurements[0]["kept_max_ever"] <= 48 + 32 and model.measurements[0]["budget_scope"] == "decode"


def test_local_tasks_run_under_a_policy(tiny_llama, tmp_path):
    from lm_eval.tasks import TaskManager

    model = KvbenchLM(pretrained=tiny_llama, policy=build_policy("window"), budget=8)
    results = lm_eval.simple_evaluate(model=model, tasks=["local_qa", "local_mc"], bootstrap_iters=0,
                                      task_manager=TaskManager(include_path=local_tasks(tmp_path),
                                                               include_defaults=False))
    assert results["results"]["local_qa"]["exact_match,none"] == 0.0  # random weights
    assert {"local_qa", "local_mc"} <= set(results["results"])
    kinds = [m["request_type"] for m in model.measurements]
    assert kinds.count("generate_until") == 3 and kinds.count("loglikelihood") == 6
    assert all(m["kept_max"] <= 9 for m in model.measurements)


def test_bad_model_args_are_one_line_errors(tiny_llama):
    from kvbench.errors import KvbenchError

    with pytest.raises(KvbenchError, match="no context/question split"):
        KvbenchLM(pretrained=tiny_llama, question="agnostic")
    with pytest.raises(KvbenchError, match="has no parameter 'windw'"):
        KvbenchLM(pretrained=tiny_llama, policy="snapkv", windw=3)
    assert KvbenchLM(pretrained=tiny_llama, policy="snapkv", **{"policy.window": 16}).kv_policy.window == 16


def test_lm_eval_tasks_as_sweep_cells(tmp_path):
    from tests.test_sweep import sweep, write_config

    tasks = local_tasks(tmp_path)
    config = write_config(tmp_path, {
        "name": "lmeval", "model": {"id": "random:tiny-llama", "dtype": "float32", "device": "cpu"},
        "policies": ["full", "window"], "budgets": [8], "context_lengths": [64], "samples": 2,
        "tasks": [{"name": "lm_eval", "tasks": ["local_qa", "local_mc"], "include_path": tasks}]})
    run = tmp_path / "run"
    sweep(config, run)
    records = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 4  # 2 cells x (2 docs of each task)
    mc = [r for r in records if r["lm_eval"]["task"] == "local_mc"]
    assert all(r["lm_eval"]["metric"] == "acc" and r["scores"]["score"] in (0.0, 1.0) for r in mc)
    assert all(len(r["lm_eval"]["responses"]) == 3 for r in mc)  # one loglikelihood per choice
    window = [r for r in records if r["policy"]["name"] == "window"]
    assert all(r["kept_max"] <= 9 for r in window)
    summary = (run / "summary.csv").read_text()
    assert "lm_eval" in summary
    results = [json.loads(path.read_text()) for path in (run / "lm_eval").glob("*.json")]
    assert len(results) == 2 and all(set(r["results"]) == {"local_qa", "local_mc"} for r in results)


def test_a_fixed_data_task_takes_one_context_length(tmp_path):
    from kvbench.config.schema import load_config
    from kvbench.errors import KvbenchError
    from tests.test_sweep import write_config

    config = write_config(tmp_path, {
        "name": "lmeval", "model": {"id": "random:tiny-llama"}, "policies": ["full"], "budgets": [8],
        "context_lengths": [64, 128],
        "tasks": [{"name": "lm_eval", "tasks": ["local_qa"], "include_path": local_tasks(tmp_path)}]})
    with pytest.raises(KvbenchError, match="no length knob"):
        load_config(config)
    with pytest.raises(KvbenchError, match="has no task 'nosuch'"):
        from kvbench.tasks import build_task

        build_task("lm_eval", {"tasks": ["nosuch"]}).samples(None, 64, 1, 0)
    assert torch.tensor(1)  # (keeps torch imported for the fixtures' models)


def test_the_lm_eval_command_line_knows_the_kvbench_model(tmp_path):
    from typer.testing import CliRunner

    from kvbench.cli import app

    result = CliRunner().invoke(app, [
        "lm-eval", "--model", "kvbench", "--model_args", "pretrained=random:tiny-llama,policy=window,budget=8",
        "--device", "cpu", "--tasks", "local_mc", "--include_path", local_tasks(tmp_path), "--limit", "1",
        "--output_path", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    written = list((tmp_path / "out").rglob("results_*.json"))
    assert len(written) == 1 and "local_mc" in json.loads(written[0].read_text())["results"]


def synthetic_task(folder) -> str:
    """A local lm-eval task that generates its docs from `max_seq_lengths`, as RULER's do (offline)."""
    (folder / "synthetic_utils.py").write_text(
        "import datasets\n\n\n"
        "def make_docs(**kwargs):\n"
        "    rows = [{'input': 'word ' * (n // 2), 'target': 'x', 'max_length': n}\n"
        "            for n in kwargs.get('max_seq_lengths', [4096]) for _ in range(2)]\n"
        "    return {'test': datasets.Dataset.from_list(rows)}\n\n\n"
        "def process_results(doc, results):\n"
        "    return {str(doc['max_length']): float(doc['target'] in results[0])}\n")
    (folder / "synthetic.yaml").write_text(
        "task: synthetic\ndataset_path: ''\ncustom_dataset: !function synthetic_utils.make_docs\ntest_split: test\n"
        "output_type: generate_until\ndoc_to_text: '{{input}}'\ndoc_to_target: '{{target}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 2\n"
        "process_results: !function synthetic_utils.process_results\nmetric_list:\n"
        + "".join(f"  - metric: '{n}'\n    aggregation: mean\n    higher_is_better: true\n" for n in (64, 128))
        + "metadata:\n  version: 1.0\n")
    return str(folder)


def test_the_context_length_is_the_length_knob_of_a_task_that_generates_its_data(tiny_llama, tmp_path):
    from kvbench.engine.settings import RunSettings
    from kvbench.runs.runner import evaluate
    from kvbench.tasks import build_task

    task = build_task("lm_eval", {"tasks": ["synthetic"], "include_path": synthetic_task(tmp_path)})
    task.check_lengths([64, 128])  # a knob: several lengths are several grids
    prompts = {}
    for length in (64, 128):
        samples = task.samples(tiny_llama.tokenizer, length, 1, 0)
        record = evaluate(tiny_llama, task, build_policy("full"), samples[0], RunSettings(), length, 0)
        assert record["lm_eval"]["metric"] == str(length) and str(length) in record["lm_eval"]["metrics"]
        prompts[length] = record["prompt_tokens"]
    assert prompts[128] > prompts[64]  # each length's docs were made for it


def letter_context(seed: int = 1) -> str:
    """A passage, then a question whose answer is one token (`A`, `B`: bytes, to the tiny models' tokenizer)."""
    passage = " ".join(map(str, random_ids(40, seed=seed, vocab=1000)))
    return f"{passage}\nQuestion: which letter?\nA. one\nB. two\nAnswer:"


def letter_task(folder) -> str:
    """A local multiple choice whose choices are single tokens after a `Question:` marker."""
    rows = [{"context": letter_context(seed), "label": seed % 2} for seed in (1, 2)]
    (folder / "letters.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "letters.yaml").write_text(
        f"task: letters\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'letters.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{context}}\"\ndoc_to_choice: [A, B]\n"
        "target_delimiter: ''\ndoc_to_target: label\nmetric_list:\n  - metric: acc\nmetadata:\n  version: 1.0\n")
    return str(folder)


def loglikelihoods(lm, requests, policy: str = "full", budget=None, **model_args) -> list[float]:
    model = KvbenchLM(pretrained=lm, policy=build_policy(policy), budget=budget, **model_args)
    return [logprob for logprob, _ in model.loglikelihood(requests)]


@pytest.mark.parametrize("policy", ["window", "snapkv"])
def test_split_at_lets_the_policy_reach_a_single_token_answer(sharp_llama, policy):
    """The first-token trap: a one-token answer is predicted by the prefill's forward over the whole context, so it
    scores as the full cache's at any budget, unless the question arrives after compression."""
    requests = [Request(letter_context(), "A"), Request(letter_context(), "B")]
    full = loglikelihoods(sharp_llama, requests)
    aware = loglikelihoods(sharp_llama, requests, policy, 40)
    split = loglikelihoods(sharp_llama, requests, policy, 40, split_at="Question:")
    assert aware == model_approx(sharp_llama, full)
    assert all(abs(a - b) > 1e-3 for a, b in zip(split, full, strict=True))


def test_a_single_token_answer_without_a_split_warns_once(sharp_llama, caplog):
    from kvbench.tasks.lmeval_model import warn_first_token_uncompressed

    letters, words = [Request(letter_context(), "A")], [Request(letter_context(), " one")]

    def warnings(*runs) -> list[str]:
        warn_first_token_uncompressed.cache_clear()
        caplog.clear()
        for policy, requests, args in runs:
            loglikelihoods(sharp_llama, requests, policy, 40 if policy != "full" else None, **args)
        return [r.getMessage() for r in caplog.records if r.name == "kvbench.tasks.lmeval_model"]

    once = warnings(("window", letters, {}), ("snapkv", letters * 2, {}))
    assert len(once) == 1 and "split_at" in once[0] and "\n" not in once[0]
    assert warnings(("window", letters, {"split_at": "Question:"})) == []
    assert warnings(("full", letters, {}), ("window", words, {})) == []
    # a chunked prefill compresses before its last chunk's forward: that forward reads the compressed cache
    assert warnings(("window", letters, {"prefill": "chunked", "prefill_chunk": 64})) == []


def test_a_split_under_a_roomy_budget_scores_as_the_full_cache(sharp_llama):
    """The split itself changes nothing: the same tokens, the question appended after a compression that kept all."""
    context = letter_context()
    requests = [Request(context, "A"), Request(context, "B"), Request(context, " two")]
    full = loglikelihoods(sharp_llama, requests)
    model = KvbenchLM(pretrained=sharp_llama, policy=build_policy("snapkv"), budget=1000, split_at="Question:")
    assert [logprob for logprob, _ in model.loglikelihood(requests)] == model_approx(sharp_llama, full)
    assert model.measurements[0]["question_tokens"] == len("Question: which letter?\nA. one\nB. two\nAnswer:")
    generate = Request(context, {"until": ["\n"], "max_gen_toks": 5})
    split = KvbenchLM(pretrained=sharp_llama, policy=build_policy("window"), budget=1000, split_at="re:\\nQ")
    assert split.generate_until([generate]) == KvbenchLM(pretrained=sharp_llama).generate_until([generate])
    assert split.measurements[0]["question_tokens"] == len("\nQuestion: which letter?\nA. one\nB. two\nAnswer:")


@needs_embedded
def test_the_split_keeps_the_whole_contexts_tokens(smollm):
    """A real BPE tokenizer merges the space before `Question` into one token: that token is appended whole."""
    text = "The pass key is 31415. Remember it. Question: what is the pass key?\nAnswer:"
    model = KvbenchLM(pretrained=smollm, split_at="Question:")
    ids = model.tok_encode(text)
    head, question = model._split(text, ids, "a test")
    assert head + question == ids and smollm.tokenizer.decode(question[:1]) == " Question"
    requests = [Request(text, " 3"), Request(text, " 4")]
    assert [logprob for logprob, _ in model.loglikelihood(requests)] == \
        model_approx(smollm, loglikelihoods(smollm, requests))


def test_a_context_without_the_marker_is_a_one_line_error(tiny_llama):
    from kvbench.errors import KvbenchError

    model = KvbenchLM(pretrained=tiny_llama, split_at="Question:")
    with pytest.raises(KvbenchError, match=r"split_at=Question:: the context of task 'test' doc 0 has no such"):
        model.loglikelihood([Request("no marker here", " a")])
    with pytest.raises(KvbenchError, match="doc 0 has no such marker"):
        model.generate_until([Request("no marker here", {"until": ["\n"], "max_gen_toks": 2})])
    with pytest.raises(KvbenchError, match="has nothing before such marker"):
        model.loglikelihood([Request("Question: first", " a")])
    with pytest.raises(KvbenchError, match="not a regular expression"):
        KvbenchLM(pretrained=tiny_llama, split_at="re:(")
    with pytest.raises(KvbenchError, match="question=agnostic needs split_at"):
        KvbenchLM(pretrained=tiny_llama, question="agnostic")
    with pytest.raises(KvbenchError, match="question=aware compresses each context whole"):
        KvbenchLM(pretrained=tiny_llama, question="aware", split_at="Question:")
    few_shot = "Question: a?\nAnswer: b\n\nQuestion: c?\nAnswer:"  # the last occurrence: the examples are compressed
    assert model._split(few_shot, model.tok_encode(few_shot), "a test")[1] == model.tok_encode("Question: c?\nAnswer:")


def test_the_sweep_splits_its_agnostic_cells_at_split_at(tmp_path, tiny_llama):
    from kvbench.engine.models import load_model
    from kvbench.engine.settings import RunSettings
    from kvbench.errors import KvbenchError
    from kvbench.tasks import build_task
    from tests.test_sweep import sweep, write_config

    task = {"name": "lm_eval", "tasks": ["letters"], "include_path": letter_task(tmp_path), "split_at": "Question:"}
    config = write_config(tmp_path, {
        "name": "split", "model": {"id": "random:tiny-llama", "dtype": "float32", "device": "cpu"},
        "policies": ["full", "snapkv"], "budgets": [40], "context_lengths": [512], "samples": 2,
        "question": ["aware", "agnostic"], "tasks": [task]})
    sweep(config, tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "records.jsonl").read_text().splitlines()]
    responses = {(r["policy"]["name"], r["question"], r["sample_id"]): r["lm_eval"]["responses"] for r in records}
    assert len(responses) == 8
    for doc in ("letters-0", "letters-1"):
        # the sweep's model is the `tiny_llama` fixture's (random:tiny-llama in float32): its tolerance
        assert responses["snapkv", "aware", doc] == model_approx(tiny_llama, responses["full", "aware", doc])
        assert responses["full", "agnostic", doc] == model_approx(tiny_llama, responses["full", "aware", doc])
        assert responses["snapkv", "agnostic", doc] != model_approx(tiny_llama, responses["snapkv", "aware", doc])
    unsplit = build_task("lm_eval", {"tasks": ["letters"], "include_path": task["include_path"]})
    lm = load_model("random:tiny-llama", dtype="float32", device="cpu")
    with pytest.raises(KvbenchError, match="question: agnostic needs `split_at`"):
        unsplit.run(lm, build_policy("full"), unsplit.samples(lm.tokenizer, 512, 1, 0)[0],
                    RunSettings(question="agnostic"))


def test_the_lm_eval_help_lists_the_kvbench_model_args_then_lm_evals_usage():
    import inspect

    from typer.testing import CliRunner

    from kvbench.cli import app

    for flag in ("--help", "-h"):
        result = CliRunner().invoke(app, ["lm-eval", flag])
        assert result.exit_code == 0, result.output
        for name in ("pretrained", "policy.<param>", "budget", "split_at", "question", "score_chunk"):
            assert f"\n  {name} " in result.output, (flag, name)
        assert result.output.index("split_at") < result.output.index("usage: lm-eval")
    from kvbench.tasks.lmeval_model import MODEL_ARGS

    taken = set(inspect.signature(KvbenchLM.__init__).parameters)
    # lm-eval's batching arguments are taken and ignored (a request runs alone), `settings` is for Python callers
    assert set(MODEL_ARGS) - {"policy.<param>"} == taken - {"self", "settings", "params", "batch_size",
                                                            "max_batch_size"}


def test_an_unknown_lm_eval_task_is_one_line_before_the_model_loads(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import kvbench.tasks.lmeval_model
    from kvbench.cli import app

    def no_model(*args, **kwargs):
        raise AssertionError("the model loaded before the tasks were checked")

    monkeypatch.setattr(kvbench.tasks.lmeval_model, "load_model", no_model)
    result = CliRunner().invoke(app, [
        "lm-eval", "run", "--model", "kvbench", "--model_args", "pretrained=random:tiny-llama", "--tasks",
        "local_mc,local_qb", "--include_path", local_tasks(tmp_path)])
    assert result.exit_code == 2, result.output
    assert "no task 'local_qb' (did you mean 'local_qa'?)" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_lm_evals_log_outlives_a_command_whose_output_was_captured(capsys, monkeypatch):
    """lm-eval's log handler must not keep the captured (then closed) stderr of the command that set it up."""
    import logging

    import lm_eval.utils
    from typer.testing import CliRunner

    from kvbench.cli import app

    logger = logging.getLogger("lm_eval")
    monkeypatch.setattr(lm_eval.utils, "_LOGGING_CONFIGURED", False)  # as in a fresh process
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "propagate", logger.propagate)
    monkeypatch.setattr(logger, "level", logger.level)
    assert CliRunner().invoke(app, ["lm-eval", "--help"]).exit_code == 0
    logger.warning("a later record")
    err = capsys.readouterr().err
    assert "Logging error" not in err and "a later record" in err


def test_a_tasks_missing_data_file_is_one_line(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from kvbench.cli import app

    examples = Path(__file__).resolve().parents[1] / "examples" / "lm_eval"
    monkeypatch.chdir(tmp_path)  # the example's data_files resolve from the repository root only
    result = CliRunner().invoke(app, [
        "lm-eval", "run", "--model", "kvbench", "--model_args", "pretrained=random:tiny-llama", "--tasks", "passkey",
        "--include_path", str(examples), "--device", "cpu", "--limit", "1"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert "passkey.jsonl" in lines[-1] and "relative to the folder you run from" in lines[-1], result.output
    assert "Traceback" not in result.output
