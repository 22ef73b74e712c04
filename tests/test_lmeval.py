"""The lm-eval bridge: requests really go through the compressed cache; lm-eval tasks as sweep cells, offline."""

from __future__ import annotations

import json

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from kvbench.lmeval import KvbenchLM  # noqa: E402
from kvbench.policies import build_policy  # noqa: E402
from tests.conftest import random_ids  # noqa: E402

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
    assert roomy == pytest.approx(full, abs=1e-4)


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
        assert a == pytest.approx(b, abs=1e-4) and greedy_a == greedy_b


def test_rolling_loglikelihood_streams_through_the_cache(tiny_llama):
    text = tiny_llama.tokenizer.decode(random_ids(200, seed=3, vocab=200))
    full = KvbenchLM(pretrained=tiny_llama, stream_chunk=32).loglikelihood_rolling([Request(text)])[0]
    model = KvbenchLM(pretrained=tiny_llama, policy=build_policy("window"), budget=48, stream_chunk=32)
    windowed = model.loglikelihood_rolling([Request(text)])[0]
    assert windowed != pytest.approx(full, abs=1e-3)
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
    from kvbench.config import load_config
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
    from kvbench.runner import evaluate
    from kvbench.session import RunSettings
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
