"""TRL's side of ``benchmarks/trl_compare.py``: one on-policy distillation run with TRL's ``DistillationTrainer``.

Runs in TRL's own virtualenv (``trl_compare.py`` creates it), not in the project's: nothing here imports
megatron_gkd. Writes one JSON line of figures to ``--result``::

    <trl venv>/bin/python benchmarks/trl_side.py --student S --teacher T --prompts P.jsonl --steps 40 \\
        --batch 16 --max-tokens 24 --result out.json
"""

from __future__ import annotations

import argparse
import json
import resource
import time

STARTED = time.perf_counter()  # before the heavy imports: start-up counts them, as the trainer's does

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from teacher_memory import status  # noqa: E402  (the standard library only: benchmarks/ is the script's directory)
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import DistillationConfig, DistillationTrainer  # noqa: E402


class StepTimes(TrainerCallback):
    """The wall time of each optimizer step (generation, teacher forward and update included)."""

    def __init__(self):
        self.first_step_at, self.begun, self.times = None, None, []

    def on_step_begin(self, args, state, control, **kwargs):
        self.begun = time.perf_counter()
        if self.first_step_at is None:
            self.first_step_at = self.begun

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self.begun)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--student", required=True)
    parser.add_argument("--teacher", required=True)
    parser.add_argument("--prompts", required=True, help="JSONL records with a 'prompt' text field")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=16, help="prompts per step (one sample each)")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", required=True, help="TRL's output directory")
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with open(args.prompts) as handle:
        prompts = [json.loads(line)["prompt"] for line in handle if line.strip()]
    dataset = Dataset.from_dict({"prompt": prompts[: args.steps * args.batch]})
    tokenizer = AutoTokenizer.from_pretrained(args.student)
    config = DistillationConfig(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1, learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
        max_completion_length=args.max_tokens, temperature=1.0, beta=0.0,  # beta 0: forward KL
        logging_steps=10, save_strategy="no", report_to=[], use_cpu=True, bf16=False, seed=0,
        dataloader_num_workers=0, disable_tqdm=True,
        # TRL turns activation checkpointing on by default (memory for a recomputed forward); off is its faster
        # configuration, and these shapes fit in memory without it.
        gradient_checkpointing=False)
    timer = StepTimes()
    student, teacher = (AutoModelForCausalLM.from_pretrained(args.student),
                        AutoModelForCausalLM.from_pretrained(args.teacher))
    loaded = status()  # transformers maps the checkpoints: a weight is read when a step first touches it
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=config,
                                  train_dataset=dataset, processing_class=tokenizer, callbacks=[timer])
    trainer.train()
    finished = time.perf_counter()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    result = {"system": "trl", "steps": len(timer.times), "step_times": timer.times,
              "startup_s": timer.first_step_at - STARTED, "train_s": finished - timer.first_step_at,
              "process_s": finished - STARTED, "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
              "losses": losses, "threads": args.threads, "rss_after_load_gib": loaded}
    with open(args.result, "w") as handle:
        handle.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
