"""What a policy buys a service whose KV memory is full: the highest Poisson rate each policy sustains at an SLO (its
attainment of requests within it, found by `rates: auto`'s search), in a pool that holds about two full-cache
requests, on the embedded model; and the aten ops one decode step dispatches at 1, 4 and 8 running requests, the pool's
batched step beside the joint one that attends request by request.

    python benchmarks/load.py [--model smollm2-135m] [--task niah|longgen] [--context 512] [--tokens 96]
                              [--requests 8] [--policies full snapkv window h2o] [--budget 0.25] [--start 0.05]
                              [--refine 2]

Two workloads: needle questions of `--context` tokens (scored by the task; a found needle is a short answer, so the
prefill binds), or passages of a book continued for `--tokens` (`--task longgen`: long answers, so decode and the
pool bind; quality is the perplexity of the book's own continuation through the policy's cache, teacher-forced, each
passage alone). Every policy serves the same requests at the same seeded arrivals, scaled by the rate. Reports per
policy the sustained rate, every rate tried with its attainment, the quality (the needle's score at the sustained
rate, or the perplexity), the pool's rows, and whether each of its finished answers equals its unbatched run
(`generate`); then each policy's sustained rate and quality over full's, measured in this one run. The op count is
the machine's independent measure of a step's cost: the pool's batched step's stays flat as requests join, the joint
step's grows with them.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import torch

from kvbench.engine.generation import Prompt, answer, generate
from kvbench.engine.instruments import PeakMemory, StepWork
from kvbench.engine.models import LoadedModel, load_model
from kvbench.engine.pool import Pool, pool_plan
from kvbench.engine.session import Session, step_together
from kvbench.engine.settings import RunSettings
from kvbench.policies import build_policy
from kvbench.runs.load_cell import searched_rates
from kvbench.serving import Load, Served, Service, pool_bytes, service_metrics
from kvbench.tasks import build_task
from kvbench.tasks.base import Sample, encode_prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--task", choices=["niah", "longgen"], default="niah",
                        help="needle questions (scored, short answers), or passages of a book continued for --tokens "
                             "(long answers: decode and the pool bind; quality: the perplexity of the book's own "
                             "continuation through the policy's cache, teacher-forced alone)")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--policies", nargs="+", default=["full", "snapkv", "window", "h2o"])
    parser.add_argument("--budget", type=_budget, default=0.25,
                        help="every policy but full's: a share of the prompt (0.25), or tokens (128: every request "
                             "bounded alike, so a decode-time policy's rows share a pool)")
    parser.add_argument("--ttft", type=float, default=10.0, help="SLO: seconds to the first token")
    parser.add_argument("--tpot", type=float, default=0.5, help="SLO: seconds per output token")
    parser.add_argument("--attainment", type=float, default=0.9)
    parser.add_argument("--start", type=float, default=0.05, help="the search's first rate, requests/s")
    parser.add_argument("--limit", type=float, default=12.8)
    parser.add_argument("--refine", type=int, default=2)
    parser.add_argument("--skip-ops", action="store_true", help="leave out the joint step's op count")
    args = parser.parse_args()

    lm = load_model(args.model)
    if not args.skip_ops:
        joint_step_ops(lm, args.context)
    if args.task == "niah":
        task = build_task("niah", {"depths": [0.25, 0.5, 0.75]})
        samples = task.samples(lm.tokenizer, args.context, 4, 0)
        references = [samples[i % len(samples)] for i in range(args.requests)]
        prompts = []
        for sample in references:
            context, question = encode_prompt(lm.tokenizer, sample)
            prompts.append(Prompt(context, question, args.tokens))
    else:
        task = build_task("longgen", {"length": args.tokens})
        references = task.samples(lm.tokenizer, args.context, args.requests, 0)
        prompts = [Prompt(sample.token_ids, [], args.tokens, ()) for sample in references]
    longest = max(len(p.context) + len(p.question) for p in prompts)
    pool = pool_bytes(lm, f"{2 * (longest + args.tokens)} tokens", None)
    assert pool is not None, "a pool given in tokens has bytes"
    print(f"pool {pool / 2**20:.1f} MiB ({2 * (longest + args.tokens)} tokens), {args.requests} requests of "
          f"~{longest} prompt and <= {args.tokens} answer tokens, SLO TTFT <= {args.ttft} s, TPOT <= {args.tpot} s, "
          f"sustained at {args.attainment:.0%} within it")
    sustained, scores = {}, {}
    for name in args.policies:
        settings = RunSettings(budget=None if name == "full" else args.budget)
        held, order, tried = search(lm, name, settings, prompts, pool, args)
        sustained[name] = held or 0.0
        served, metrics = tried[order[0] if held is None else held]
        finished = [r for r in served.requests if r.finished_s is not None]
        texts = [answer(lm, r.tokens, lm.eos_token_ids, ()) for r in finished]
        if args.task == "niah":
            score = sum(task.score(text, references[r.index]).get("score", 0.0)
                        for r, (text, _) in zip(finished, texts, strict=True)) / max(len(finished), 1)
            quality = f"score {score:.2f}"
        else:
            score = perplexity(lm, name, settings, references)
            quality = f"perplexity {score:.2f}"
        scores[name] = score
        same = all(tokens == generate(lm, build_policy(name, {}), r.prompt.context, r.prompt.question, settings,
                                      args.tokens).tokens for r, (_, tokens) in zip(finished, texts, strict=True))
        rates = ", ".join(f"{rate:g}: {tried[rate][1]['slo_attained']:.2f}" for rate in sorted(tried))
        print(f"{name:7s} sustains {'none' if held is None else f'{held:g} req/s'}  {quality}  "
              f"p99 TTFT {metrics['ttft_p99']:.1f} s  p50 TPOT {1000 * (metrics['tpot_p50'] or 0):.0f} ms  "
              f"running {metrics['concurrency_mean']:.1f} (peak {metrics['concurrency_peak']}, "
              f"rows {metrics['pool_rows']}, step {metrics['pool_step']})  "
              f"answers as alone: {same}  [rate: attainment {rates}]", flush=True)
    if sustained.get("full"):
        print("sustained rate vs full: " + ", ".join(f"{name} {rate / sustained['full']:.2f}x"
                                                      for name, rate in sustained.items() if name != "full"))
    elif "full" in sustained:
        print(f"sustained rate vs full: undefined, full holds no rate down to {args.start:g} req/s")
    if "full" in scores:  # quality as a share of full's: a score, or full's perplexity over the policy's
        share = {name: (score / scores["full"] if args.task == "niah" else scores["full"] / score) if score else 0.0
                 for name, score in scores.items() if name != "full"}
        print("quality vs full: " + ", ".join(f"{name} {value:.3f}" for name, value in share.items()))


def search(lm: LoadedModel, name: str, settings: RunSettings, prompts: list[Prompt], pool: int | None,
           args: argparse.Namespace) -> tuple[float | None, list[float], dict[float, tuple[Served, dict]]]:
    """`searched_rates` over services of `prompts` under `name`: the rate held, the rates tried in order, and what
    each served and measured."""
    tried: dict[float, tuple[Served, dict]] = {}

    def attained(rate: float) -> float:
        load = Load(requests=args.requests, rate=rate, pool_bytes=pool, slo_ttft_s=args.ttft, slo_tpot_s=args.tpot)
        with PeakMemory(lm.devices) as memory:
            served = Service(lm, build_policy(name, {}), settings, prompts, load, memory).run()
        tried[rate] = served, service_metrics(served, load)
        return tried[rate][1]["slo_attained"] or 0.0

    held, _, order = searched_rates(attained, {"start": args.start, "limit": args.limit, "refine": args.refine},
                                    args.attainment)
    return held, order, tried


def joint_step_ops(lm: LoadedModel, context: int) -> None:
    """Aten ops one decode step of 1, 4 and 8 running requests dispatches, full and SnapKV: the pool's batched step,
    and the joint step that attends request by request (what a policy that cannot pool steps by)."""
    generator = torch.Generator().manual_seed(0)
    counts = {}
    for name, budget in (("full", None), ("snapkv", 0.25)):
        settings = RunSettings(budget=budget)
        for running in (1, 4, 8):
            pooled = [Session(lm, build_policy(name, {}), settings, prompt_tokens=context, adds=8)
                      for _ in range(running)]
            plan = pool_plan(pooled, context + 9)
            assert not isinstance(plan, str), plan
            pool = Pool(lm, plan, rows=8)
            joint = []
            for session in pooled:
                prompt = torch.randint(0, 1000, (1, context), generator=generator)
                session.prefill(prompt)
                pool.join(session)
                joint.append(Session(lm, build_policy(name, {}), settings, prompt_tokens=context, adds=8))
                joint[-1].prefill(prompt)
            counts["pool", name, running] = _step_ops(pool.step, running)
            counts["joint", name, running] = _step_ops(partial(step_together, joint), running)
    for kind in ("pool", "joint"):
        print(f"aten ops per {kind} decode step (1 / 4 / 8 running requests): " + "; ".join(
            f"{name} {counts[kind, name, 1]} / {counts[kind, name, 4]} / {counts[kind, name, 8]}"
            for name in ("full", "snapkv")))


def perplexity(lm: LoadedModel, name: str, settings: RunSettings, samples: list[Sample]) -> float:
    """The mean perplexity of each passage's own continuation through `name`'s cache, token by token as if
    generated (the long-generation task's score), each passage alone."""
    values = []
    for sample in samples:
        continuation = sample.meta["continuation"]
        session = Session(lm, build_policy(name, {}), settings, prompt_tokens=len(sample.token_ids),
                          adds=len(continuation))
        session.prefill(sample.token_ids)
        values.append(float((-session.score(continuation, chunk=1).logprobs).mean().exp()))
    return sum(values) / len(values)


def _budget(text: str) -> float | int:
    value = float(text)
    return int(value) if value >= 1 else value


def _step_ops(step: Callable[[list[int]], torch.Tensor], running: int) -> int:
    """Aten ops of a decode step of `running` requests, after one to warm up."""
    step([1] * running)
    with StepWork() as work:
        step([1] * running)
    return work.ops


if __name__ == "__main__":
    main()
