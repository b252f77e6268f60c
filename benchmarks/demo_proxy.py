"""A fast, single-process stand-in for the demo's run, to screen recipes over many seeds (issue #30).

    python benchmarks/demo_proxy.py --seeds 0 1 2 3 4                       # the demo's recipe
    python benchmarks/demo_proxy.py --seeds 0 1 2 3 4 --lr 5e-3 --tag lr5e-3 # one change
    python benchmarks/demo_proxy.py --report                                # the table of what has finished

The demo (``bash scripts/run_demo.sh``) takes 8-13 minutes a run; whether a recipe leaves the carries plateau
on every seed needs many runs. This loop does what the demo's run does, in one process with the Hugging Face
models instead of Megatron, vLLM and the teacher service: the same committed student and teacher, the same
prompts in the same order (``PromptSampler``), the student's own samples at T=1 drawn one step behind its
weights (``one_step_off``), forward KL over the teacher's whole vocabulary as a token mean over the batch,
Adam with the demo's warm-up, cosine decay and clipping, and greedy eval of the 500 held-out problems scored
on the final answer. It is not the demo bit for bit (other kernels, other sampling draws): it screens a recipe
by the spread of its runs, and the demo's own runs then confirm what it picked. Results go to
``outputs/demo_proxy/<tag>_s<seed>.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import time

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from megatron_gkd.data.sampler import PromptSampler

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "outputs" / "demo_proxy"


def read_records(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = torch.tensor([[pad] * (width - len(row)) + row for row in rows])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    return ids, mask


def logits_of(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits.float()


@torch.no_grad()
def generate(model, prompts: list[list[int]], *, max_tokens: int, eos: int, pad: int,
             generator: torch.Generator | None, temperature: float = 1.0) -> list[list[int]]:
    """Responses (ending at EOS or ``max_tokens``): sampled at ``temperature``, greedy without a generator."""
    ids, mask = left_pad(prompts, pad)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    done = torch.zeros(len(prompts), dtype=torch.bool)
    out: list[list[int]] = [[] for _ in prompts]
    cache = None
    for _ in range(max_tokens):
        result = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
        cache, last = result.past_key_values, result.logits[:, -1].float()
        if generator is None:
            token = last.argmax(-1)
        else:
            token = torch.multinomial(torch.softmax(last / temperature, -1), 1, generator=generator).squeeze(-1)
        for row in torch.nonzero(~done).flatten().tolist():
            out[row].append(int(token[row]))
        done |= token == eos
        if bool(done.all()):
            break
        ids, positions = token[:, None], positions[:, -1:] + 1
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return out


def batch_of(prompts: list[list[int]], responses: list[list[int]], pad: int):
    """Left-padded prompt + right-padded response, the loss mask on response tokens (positions predicting them)."""
    rows = [prompt + response for prompt, response in zip(prompts, responses)]
    width = max(len(p) for p in prompts) + max(len(r) for r in responses)
    ids = torch.full((len(rows), width), pad)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width - 1), dtype=torch.bool)
    prompt_width = max(len(p) for p in prompts)
    for row, (prompt, response) in enumerate(zip(prompts, responses)):
        start = prompt_width - len(prompt)
        ids[row, start:start + len(prompt) + len(response)] = torch.tensor(prompt + response)
        mask[row, start:start + len(prompt) + len(response)] = 1
        loss_mask[row, prompt_width - 1:prompt_width - 1 + len(response)] = True
    return ids, mask, loss_mask


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    if args.decay == "constant":
        return args.lr
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    if args.decay == "linear":
        return args.min_lr + (args.lr - args.min_lr) * (1 - progress)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def accuracy(model, tokenizer, records, prompts, *, eos: int, pad: int, max_tokens: int) -> dict[str, float]:
    """Greedy answers of the held-out problems: ``final`` (the trainer's eval/accuracy), ``worked`` (the worked
    part is right: the carries) and ``copy`` (the answer is the model's own worked part reversed)."""
    model.eval()
    responses = generate(model, prompts, max_tokens=max_tokens, eos=eos, pad=pad, generator=None)
    model.train()
    counts = {"final": 0, "worked": 0, "copy": 0}
    for record, response in zip(records, responses):
        text = tokenizer.decode([t for t in response if t != eos])
        worked, marker, answer = (part.replace(" ", "") for part in text.partition("####"))
        counts["final"] += bool(marker) and answer == record["answer"]
        counts["worked"] += worked == record["answer"][::-1]
        counts["copy"] += bool(marker) and answer == worked[::-1]
    return {key: value / len(records) for key, value in counts.items()}


def run(args, seed: int) -> dict:
    torch.manual_seed(seed)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(ROOT / "assets/demo/student")
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id or 0
    student = AutoModelForCausalLM.from_pretrained(ROOT / args.student, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(ROOT / "assets/demo/teacher", dtype=torch.float32).eval()
    train = read_records(ROOT / args.task / "train.jsonl")
    evals = read_records(ROOT / args.task / "eval.jsonl")
    encode = lambda texts: tokenizer(texts, add_special_tokens=True)["input_ids"]  # noqa: E731
    train_prompts = encode([r["prompt"] for r in train])
    train_refs = [ids + [eos] for ids in tokenizer([" " + r["response"] for r in train], add_special_tokens=False)["input_ids"]]
    eval_prompts = encode([r["prompt"] for r in evals])
    sampler = PromptSampler(len(train), args.prompts, shuffle=True, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    mix = torch.Generator().manual_seed(seed + 10_000)
    optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr, betas=(0.9, args.beta2), eps=1e-8,
                                  weight_decay=args.weight_decay)
    skills = {0: accuracy(student, tokenizer, evals, eval_prompts, eos=eos, pad=pad, max_tokens=12)}
    print(f"seed {seed} step 0 {skills[0]}", flush=True)

    def draw():
        positions = sampler.next_batch()
        prompts = [train_prompts[p] for p in positions]
        if args.lmbda < 1 and float(torch.rand((), generator=mix)) >= args.lmbda:
            return prompts, [train_refs[p] for p in positions]
        repeated = [p for p in prompts for _ in range(args.n)]
        return repeated, generate(student, repeated, max_tokens=12, eos=eos, pad=pad, generator=generator,
                                  temperature=args.temperature)

    start = time.perf_counter()
    if args.sft_steps:  # a longer warm start: more of the SFT run the committed student is a prefix of
        sft_sampler = PromptSampler(len(train), args.prompts, shuffle=True, seed=seed + 20_000)
        sft = torch.optim.AdamW(student.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        for _ in range(args.sft_steps):
            positions = sft_sampler.next_batch()
            ids, mask, loss_mask = batch_of([train_prompts[p] for p in positions], [train_refs[p] for p in positions], pad)
            logp = torch.log_softmax(logits_of(student, ids, mask)[:, :-1], -1)
            loss = -logp.gather(-1, ids[:, 1:, None]).squeeze(-1)[loss_mask].mean()
            sft.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(student.parameters(), args.clip)
            sft.step()
        skills["sft"] = accuracy(student, tokenizer, evals, eval_prompts, eos=eos, pad=pad, max_tokens=12)
        print(f"seed {seed} after {args.sft_steps} more SFT steps {skills['sft']}", flush=True)
    pending = draw()
    losses = []
    for step in range(args.steps):
        prompts, responses = pending
        pending = draw() if args.scheduler == "one_step_off" else None  # sampled by the weights before this update
        ids, mask, loss_mask = batch_of(prompts, responses, pad)
        with torch.no_grad():
            teacher_logp = torch.log_softmax(logits_of(teacher, ids, mask)[:, :-1] / args.teacher_temperature, -1)
        student_logp = torch.log_softmax(logits_of(student, ids, mask)[:, :-1], -1)
        per_token = (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1)
        loss = per_token[loss_mask].mean()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), args.clip)
        optimizer.step()
        losses.append(float(loss.detach()))
        if pending is None:
            pending = draw()
        if (step + 1) % args.eval_interval == 0 or step + 1 == args.steps:
            skills[step + 1] = accuracy(student, tokenizer, evals, eval_prompts, eos=eos, pad=pad, max_tokens=12)
            print(f"seed {seed} step {step + 1} acc {skills[step + 1]['final']:.3f} worked {skills[step + 1]['worked']:.3f} "
                  f"copy {skills[step + 1]['copy']:.3f} loss {sum(losses[-50:]) / 50:.4f} {time.perf_counter() - start:.0f}s",
                  flush=True)
    curve = {step: values["final"] for step, values in skills.items() if step != "sft"}
    return {"seed": seed, "curve": curve, "skills": skills, "final": curve[args.steps],
            "seconds": time.perf_counter() - start,
            "args": {k: v for k, v in vars(args).items() if k not in ("seeds", "report")}}


def report() -> None:
    rows: dict[str, list[dict]] = {}
    for path in sorted(OUT.glob("*.json")):
        result = json.loads(path.read_text())
        rows.setdefault(result["args"]["tag"], []).append(result)
    print("| recipe | seeds | finals | min | landed (>= 0.8) |\n|---|---|---|---|---|")
    for tag, results in rows.items():
        results = sorted(results, key=lambda r: r["seed"])
        finals = [r["final"] for r in results]
        print(f"| {tag} | {' '.join(str(r['seed']) for r in results)} | {' '.join(f'{f:.3f}' for f in finals)} | "
              f"{min(finals):.3f} | {sum(f >= 0.8 for f in finals)}/{len(finals)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--tag", default="demo")
    parser.add_argument("--student", default="assets/demo/student")
    parser.add_argument("--task", default="outputs/demo_task")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--prompts", type=int, default=64, help="prompts a step")
    parser.add_argument("--n", type=int, default=1, help="samples a prompt")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--min-lr", type=float, default=3e-4)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--decay", choices=["cosine", "linear", "constant"], default="cosine")
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--beta2", type=float, default=0.999)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--temperature", type=float, default=1.0, help="the student's sampling temperature")
    parser.add_argument("--teacher-temperature", type=float, default=1.0)
    parser.add_argument("--lmbda", type=float, default=1.0, help="share of steps on the student's samples")
    parser.add_argument("--sft-steps", type=int, default=0, help="SFT steps on the references before distilling")
    parser.add_argument("--scheduler", choices=["one_step_off", "sync"], default="one_step_off")
    parser.add_argument("--eval-interval", type=int, default=150)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--report", action="store_true")
    args = parser.parse_args()
    if args.report:
        report()
        return
    torch.set_num_threads(args.threads)
    OUT.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        result = run(args, seed)
        (OUT / f"{args.tag}_s{seed}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
