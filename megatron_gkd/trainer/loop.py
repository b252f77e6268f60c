"""The distillation trainer: ``Trainer(config).train()`` under torchrun (SPMD: every rank runs it).

One step reads ``rollout -> teacher -> student forward/backward -> optimizer -> weight sync -> log /
eval / checkpoint``; each phase is a method with a named timer. The scheduler (:mod:`.schedulers`)
decides how far batch production runs ahead of the update that trains it.
"""

from __future__ import annotations

import logging
import os
import pathlib
import signal
import time

import torch
import torch.distributed as dist

from megatron_gkd import parallel, platform
from megatron_gkd.config import GKDConfig, check_layout, eval_enabled, needs_rollout, needs_teacher, to_yaml
from megatron_gkd.config.schema import MODES
from megatron_gkd.data import PromptSampler, load_prompts, load_tokenizer
from megatron_gkd.parallel.comm import all_gather_msgpack, broadcast_msgpack
from megatron_gkd.rollout.types import RolloutBatch
from megatron_gkd.trainer import checkpointing
from megatron_gkd.trainer.batch import token_coefficients
from megatron_gkd.trainer.components import (build_rollout_engine, build_student,
                                             build_teacher_head, check_teacher, rollout_engine_kwargs, stop_token_ids)
from megatron_gkd.trainer.eval import Evaluator
from megatron_gkd.trainer.flow import BatchFlow, InFlight
from megatron_gkd.trainer.metrics import MetricsWriter, Progress, Timers, summary_table
from megatron_gkd.trainer.routing import RoutingStats
from megatron_gkd.trainer.schedulers import SCHEDULERS, BatchPipeline
from megatron_gkd.trainer.step import LossSpec, StepRunner
from megatron_gkd.trainer.teachers import Teachers

logger = logging.getLogger(__name__)

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Trainer:
    """Builds every part of a run from ``config`` and trains (call after ``platform.setup()``)."""

    def __init__(self, config: GKDConfig):
        self.config = config
        self.out = pathlib.Path(config.trainer.output_dir)
        self.timers = Timers()
        self.step = 0
        self.tokens_trained = 0  # response tokens of the trained batches (trainer.token_budget)
        self.writer = self.progress = None
        self._unwritten: dict = {}  # metrics for the next record (start-up's)
        self._rollout_version = 0  # weights the rollout engine (or server) holds
        self._receiver = self._sync_plan = self.evaluator = None
        self._signal: int | None = None
        try:
            self._build()
        except BaseException:
            self.close()  # a teacher service or rollout server already started must not outlive the run
            raise

    def _build(self) -> None:
        phase = Timers()
        with phase("process"):
            self._setup_process()
        with phase("teacher_service_start"):
            self._start_teacher_service()
        with phase("data"):
            self._load_data()
        with phase("student"):
            self._build_student()
        # The teacher services load their models in their own processes meanwhile: the rollout engine is
        # built before the trainer waits for them, not after.
        with phase("rollout"):
            self._build_rollout()
        with phase("teacher_wait"):
            self._connect_teacher()
        with phase("resume"):
            self._resume()
        self._open_sinks()
        self._report_startup(phase.pop())
        for signum in PREEMPTION_SIGNALS:
            signal.signal(signum, self._on_signal)

    def _build_student(self) -> None:
        config = self.config
        self.student = build_student(config)
        for teacher in self.teachers:
            teacher.head = build_teacher_head(teacher.config, self.state, self.student, self.tokenizer)
        self.runner = StepRunner(self.student.chunks, self.student.optimizer, self.student.lr_scheduler,
                                 tp_group=self.state.tp_group, dp_group=self._dp_gloo, dp_size=self.state.data_parallel_size,
                                 is_last_stage=self.state.is_pipeline_last_stage,
                                 teacher_heads={t.name: t.head for t in self.teachers if t.head is not None})
        self.routing = RoutingStats(self.student.chunks, self.control, data_parallel_size=self.state.data_parallel_size) \
            if self.student.is_moe else None
        self.loss_spec = self._loss_specs(config.trainer.run_mode)
        # Eval KL scores greedy samples against each teacher as the distillation modes do, in every mode.
        self._eval_kl_spec = {name: spec.eval_kl() for name, spec in self._loss_specs(MODES["off_policy"]).items()}
        self.flow = BatchFlow(config, self.state, control=self.control, dp_group=self._dp_gloo, tokenizer=self.tokenizer,
                              stop_ids=self.stop_ids, layout=self.layout, timers=self.timers,
                              loss_kind=config.trainer.run_mode.loss_kind,
                              teachers=self.teachers)

    def _report_startup(self, seconds: dict[str, float]) -> None:
        """Logs where start-up went and keeps it for the first metrics record (``time/startup/*``)."""
        seconds["total"] = sum(seconds.values())
        logger.info("started in %.1f s: %s", seconds["total"],
                    ", ".join(f"{name} {value:.1f} s" for name, value in seconds.items() if name != "total"))
        self._unwritten = {f"time/startup/{name}": value for name, value in seconds.items()}

    def _write(self, step: int, metrics: dict) -> None:
        """One metrics record (rank 0), with what start-up measured on the first."""
        self.writer.write(step, {**self._unwritten, **metrics})
        self._unwritten = {}

    # ----------------------------------------------------------------------------------------- setup
    def _setup_process(self) -> None:
        config = self.config
        if config.trainer.deterministic:
            platform.use_deterministic_algorithms()
        self.state = parallel.initialize(config.parallel)
        parallel.seed(config.trainer.seed)
        self.rank, self.world_size = self.state.rank, self.state.world_size
        # Control messages (agreement, metrics, batches) travel on host memory whatever the device.
        self.control = dist.new_group(backend="gloo")
        self._dp_gloo = self.state.dp_gloo_group
        self.layout = check_layout(config, self.world_size)
        last = torch.tensor([self.rank if self.state.is_pipeline_last_stage else -1])
        dist.all_reduce(last, op=dist.ReduceOp.MAX, group=self.control)
        self._metrics_rank = int(last)  # a last-stage rank: it holds the step's loss statistics
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "config.yaml").write_text(to_yaml(config))
        logger.info("run directory %s: %d ranks, data parallel %d, %d prompts (%d samples) per step", self.out,
                    self.world_size, self.layout["data_parallel_size"], self.layout["prompts_per_step"],
                    config.trainer.global_batch_size)

    def _start_teacher_service(self) -> None:
        self.teachers = Teachers(self.config)
        if needs_teacher(self.config) or eval_enabled(self.config):
            self.teachers.start_services(self.rank, self.out, self.control)

    def _loss_specs(self, mode):
        """The loss of ``mode``: one spec per teacher (cross-entropy where the mode does not distil)."""
        if not mode.distills:
            return LossSpec(kind="cross_entropy")
        return {t.name: LossSpec.from_config(self.config.loss, mode, t.config, len(self.tokenizer)) for t in self.teachers}

    def _load_data(self) -> None:
        config, data = self.config, self.config.data
        self.tokenizer = load_tokenizer(config.student.tokenizer_path)
        self.stop_ids = stop_token_ids(config, self.tokenizer)
        show = self.rank == 0
        self.train_data = load_prompts(data.train_path, data, self.tokenizer, show_progress=show,
                                       require_responses=not config.trainer.run_mode.samples)
        self.eval_data, self._eval_groups = None, {}
        if eval_enabled(config):
            self.eval_data = load_prompts(data.eval_path, data, self.tokenizer, show_progress=show,
                                          limit=data.num_eval_prompts)
            self._eval_groups = {record.index: record.group for record in self.eval_data}
        if self.teachers.several and self.teachers.routed:  # every record must reach a teacher
            for dataset in filter(None, (self.train_data, self.eval_data)):
                self.teachers.assign(sorted({record.group for record in dataset}, key=str))
        self.sampler = PromptSampler(len(self.train_data), self.layout["prompts_per_step"], shuffle=data.shuffle,
                                     seed=data.seed)

    def _connect_teacher(self) -> None:
        config = self.config
        if not (needs_teacher(config) or (eval_enabled(config) and config.eval.kl and len(self.teachers))):
            return

        def check(teacher):
            check_teacher(teacher.client, config, self.tokenizer, self.student.vocab_size,
                          tcad=self.flow.tcad[teacher.name] is not None,
                          teacher_hidden_size=None if teacher.head is None else int(teacher.head.shape[1]),
                          teacher=teacher.config)

        self.teachers.connect(self.rank, self.control, self.flow._asks, check)

    def _build_rollout(self) -> None:
        config = self.config
        if not needs_rollout(config):
            return
        if config.rollout.layout == "disaggregated":
            from megatron_gkd.trainer.disaggregated import RemoteRollout

            self.flow.remote = RemoteRollout(config, self.student.chunks, rollout_engine_kwargs(config, self.tokenizer),
                                             self.out / "rollout_server.log", self.control)
        else:
            self.flow.engine = build_rollout_engine(config, self.student, self.tokenizer)
            if not self.flow.engine.shares_student_weights:
                from megatron_gkd.weight_sync import build_plan

                self._sync_plan = build_plan(self.student.chunks)
        if self.eval_data is not None:
            self.evaluator = Evaluator(self.eval_data, self.tokenizer, self.flow.generate, self._eval_kl, config.eval,
                                       self.stop_ids)

    def _resume(self) -> None:
        setting = self.config.checkpoint.resume
        root = None if setting == "never" else self.out / "checkpoints" if setting == "auto" else pathlib.Path(setting)
        if root is None or (setting == "auto" and not root.exists()):
            return
        loaded = checkpointing.load_checkpoint(root, model_chunks=self.student.chunks, optimizer=self.student.optimizer,
                                               scheduler=self.student.lr_scheduler, parallel_state=self.state)
        if loaded is None:
            if setting != "auto":
                raise FileNotFoundError(f"checkpoint.resume={setting}: no complete checkpoint there")
            return
        self.step, data_state = loaded
        self.sampler.load_state_dict(data_state["sampler"])
        self.tokens_trained = int(data_state.get("tokens_trained", 0))
        logger.info("resumed at step %d (data epoch %d)", self.step, self.sampler.epoch)
        if self.step:
            self._sync_weights()

    def _open_sinks(self) -> None:
        if self.rank != 0:
            return
        from megatron_gkd.config import to_dict

        self.writer = MetricsWriter(self.out, self.config.logging, resume_step=self.step, run_config=to_dict(self.config))
        self.progress = Progress(self.config.trainer.num_steps, self.step, self.config.logging)

    # ------------------------------------------------------------------------------------------ train
    def train(self) -> dict:
        """Trains to ``trainer.num_steps`` (or a preemption signal); returns the run's summary."""
        config, start = self.config, time.perf_counter()
        first_eval = self._evaluate() if config.eval.at_start and self.step == 0 else {}
        if first_eval and self.rank == 0:
            self._write(self.step, {**first_eval, **{f"time/{k}": v for k, v in self.timers.pop().items()}})
            self.progress.evaluated(first_eval)
        schedule = SCHEDULERS.get(config.trainer.scheduler)
        self.pipeline = BatchPipeline(self._produce, max_staleness=schedule.max_staleness, start=self.step,
                                      num_batches=config.trainer.num_steps)
        metrics: dict = {}
        clock = time.perf_counter()
        while not self._finished():
            _, batch = self.pipeline.next()
            try:
                metrics = self._update(batch)
            except Exception:
                self._save_after_failure()
                raise
            self.step += 1
            self._sync_weights()
            if config.eval.interval and self.step % config.eval.interval == 0 and not self._finished():
                metrics.update(self._evaluate())
            now = time.perf_counter()
            metrics["time/step"], clock = now - clock, now  # wall time since the previous step's end
            self._log(metrics)
            self._checkpoint_if_due()
            if self._preempted():
                self._save_checkpoint()
                logger.warning("stopped by signal %s after step %d; checkpoint saved: rerun the same command to "
                               "resume", self._signal, self.step)
                return self._summary(first_eval, {}, start, preempted=True)
        if self.step < config.trainer.num_steps:
            logger.info("token budget of %d reached after step %d (%d tokens trained); %d batches sampled ahead are not "
                        "trained", config.trainer.token_budget, self.step, self.tokens_trained,
                        len(self.pipeline.in_flight))
        last_eval = self._evaluate() if config.eval.at_end else {}
        if last_eval and self.rank == 0:
            self._write(self.step, last_eval)
        if config.checkpoint.save_at_end:
            self._save_checkpoint()
        if config.checkpoint.hf_at_end:
            self._export_hf()
        return self._summary(first_eval, last_eval, start)

    def _finished(self) -> bool:
        """``trainer.num_steps`` done, or ``trainer.token_budget`` spent."""
        budget = self.config.trainer.token_budget
        return self.step >= self.config.trainer.num_steps or (budget is not None and self.tokens_trained >= budget)

    def _produce(self, index: int) -> InFlight:
        """Draws the prompts of batch ``index``, samples (or reads) responses, sends the teacher request."""
        data_state = self.sampler.state_dict()
        records = [self.train_data[position] for position in self.sampler.next_batch()]
        return self.flow.produce(index, records, data_state, version=self.step)

    def _update(self, batch: InFlight) -> dict:
        """Waits for the batch and its teacher rows, runs forward/backward over its micro-batches, steps
        the optimizer."""
        microbatches = self.flow.prepare(batch)
        with self.timers("train"):
            stats, optim = self.runner.train_step(self.loss_spec, microbatches)
        self.tokens_trained += batch.rollout.num_generated_tokens  # the whole global batch, the same on every rank
        metrics = self._batch_metrics(batch)
        metrics.update({f"train/{key}": value for key, value in optim.items()})
        if self.routing is not None:  # MoE: load-balancing loss and expert load (collective)
            metrics.update(self.routing.collect(len(microbatches)))
        if stats is not None:
            metrics.update(self._loss_metrics(stats))
            metrics.update(self.flow.confidence)
        metrics.update(self.flow.teacher_metrics(batch.teacher, batch.samples))
        return metrics

    def _sync_weights(self, force: bool = False) -> None:
        """Puts weights version ``self.step`` into the rollout engine: every step on-policy; otherwise
        only when ``force``d (off-policy and SFT sample nothing; eval refreshes the engine)."""
        engine, remote = self.flow.engine, self.flow.remote
        if (engine is None and remote is None) or self._rollout_version == self.step:
            return
        if not self.config.trainer.run_mode.samples and not force:
            return
        with self.timers("weight_sync"):
            if remote is not None:
                remote.sync(self.student.chunks, self.step)
            elif engine.shares_student_weights:
                engine.load_weights(iter(()), self.step)
            else:
                from megatron_gkd.weight_sync import colocated_sync

                self._receiver = colocated_sync(self.student.chunks, engine, self._sync_plan, self.config.weight_sync,
                                                version=self.step, receiver=self._receiver)
        self._rollout_version = self.step

    # --------------------------------------------------------------------------------------- metrics
    def _batch_metrics(self, batch: InFlight) -> dict:
        rollout = batch.rollout
        lengths = rollout.response_lengths.float()
        phases = self.timers.pop()
        metrics = {f"time/{name}": seconds for name, seconds in phases.items()}
        metrics.update({
            "rollout/response_length_mean": float(lengths.mean()), "rollout/response_length_max": float(lengths.max()),
            "rollout/num_tokens": float(rollout.num_generated_tokens),
            "rollout/truncated_fraction": sum(r == "length" for r in rollout.finish_reasons) / rollout.num_samples,
            "train/staleness": float(self.step - rollout.weight_version),
            "train/weight_version": float(rollout.weight_version), "data/epoch": float(self.sampler.epoch),
            "data/batches_sampled": float(self.pipeline.num_sampled), "data/batches_trained": float(self.step + 1),
            "train/tokens_total": float(self.tokens_trained),
        })
        for phase, tokens in (("rollout", rollout.num_generated_tokens), ("train", rollout.num_generated_tokens)):
            if phases.get(phase):
                metrics[f"throughput/{phase}_tokens_per_s"] = tokens / phases[phase]
        metrics["memory/rss_gb"] = _rss_gb()
        if platform.max_memory_allocated():
            metrics["memory/device_max_allocated_gb"] = platform.max_memory_allocated() / 2**30
        metrics["prompts"] = batch.prompt_indices
        return metrics

    def _loss_metrics(self, stats: dict) -> dict:
        """``train/*`` from the step's summed statistics (per teacher, ``KEY/NAME``, with several)."""
        metrics = {"train/loss": stats["loss"], "train/num_loss_tokens": stats["tokens"]}
        for suffix in [""] if not self.teachers.several else [f"/{name}" for name in self.teachers.names]:
            tokens = max(stats.get(f"tokens{suffix}", 0.0), 1.0)
            if suffix:
                metrics.update({f"train/loss{suffix}": stats.get(f"loss{suffix}", 0.0),
                                f"train/num_loss_tokens{suffix}": stats.get(f"tokens{suffix}", 0.0)})
            for key in ("teacher_mass", "student_mass", "topk_overlap", "teacher_entropy", "student_entropy",
                        "top1_agreement"):
                if f"{key}{suffix}" in stats:
                    metrics[f"train/{key}{suffix}"] = stats[f"{key}{suffix}"] / tokens
            if f"coverage{suffix}" in stats:
                metrics[f"train/loss_coverage{suffix}"] = stats[f"coverage{suffix}"]
                metrics[f"train/loss_divergence{suffix}"] = stats[f"loss{suffix}"] - stats[f"coverage{suffix}"]
        return metrics

    def _log(self, metrics: dict) -> None:
        with self.timers("log"):
            metrics = broadcast_msgpack(metrics if self.rank == self._metrics_rank else None, self._metrics_rank,
                                        self.control)
        self.last_metrics = metrics
        if self.rank == 0:
            self._write(self.step, metrics)
            self.progress.update(self.step, metrics, {k[5:]: v for k, v in metrics.items() if k.startswith("time/")})

    # ------------------------------------------------------------------------------------------ eval
    def _evaluate(self) -> dict:
        if self.evaluator is None:
            return {}
        with self.timers("eval"):
            self._sync_weights(force=True)
            metrics = self.evaluator.run()
        if self.rank == 0:
            logger.info("eval at step %d: %s", self.step, {k: round(v, 5) for k, v in metrics.items()})
        return metrics

    def _eval_kl(self, rollout: RolloutBatch, prompt_indices: list[int]) -> float | None:
        """Token-mean forward KL of the student to the teacher on eval responses (on the teacher's top-k, or over
        the whole vocabulary with the hidden signal)."""
        # The same answer on every rank: every DP rank needs a share of the eval prompts.
        if not (self.config.eval.kl and len(self.teachers)) or len(prompt_indices) < self.state.data_parallel_size:
            return None
        flow = self.flow
        samples = flow.my_samples(rollout, prompt_indices, [self._eval_groups.get(i) for i in prompt_indices])
        rows = flow.rows(samples, flow.teacher_outputs(flow.request(samples, tcad=False)), tcad=False)
        coefficients = token_coefficients(samples, total_tokens=rollout.num_generated_tokens,
                                          num_groups=len(prompt_indices))
        microbatches = flow.microbatches(samples, coefficients, rows, labels=False)
        with parallel.eval_mode(self.student.chunks), torch.no_grad():
            stats = self.runner.run(self._eval_kl_spec, microbatches, forward_only=True)
        value = broadcast_msgpack(stats["loss"] if stats else None, self._metrics_rank, self.control)
        return value

    # ------------------------------------------------------------------------------------ checkpoints
    def _data_state(self) -> dict:
        in_flight = self.pipeline.in_flight if hasattr(self, "pipeline") else []
        # Batches sampled but not trained are re-sampled after a resume: the position is the oldest one's.
        sampler = in_flight[0][1].data_state if in_flight else self.sampler.state_dict()
        return {"sampler": sampler, "step": self.step, "weight_version": self.step, "tokens_trained": self.tokens_trained,
                "config": to_yaml(self.config)}

    def _save_checkpoint(self) -> None:
        with self.timers("checkpoint"):
            checkpointing.save_checkpoint(self.out / "checkpoints", self.step, model_chunks=self.student.chunks,
                                          optimizer=self.student.optimizer, scheduler=self.student.lr_scheduler,
                                          data_state=self._data_state(), parallel_state=self.state,
                                          keep_last_n=self.config.checkpoint.keep_last_n,
                                          content_hashes=self.config.checkpoint.content_hashes)

    def _checkpoint_if_due(self) -> None:
        checkpoint = self.config.checkpoint
        final = self._finished()
        if checkpoint.save_interval and self.step % checkpoint.save_interval == 0 and not final:
            self._save_checkpoint()
        if checkpoint.hf_interval and self.step % checkpoint.hf_interval == 0 and not final:
            self._export_hf()

    def _save_after_failure(self) -> None:
        """After a failed step (e.g. the teacher down past its deadline): keep the last complete step."""
        if self.step and self.config.checkpoint.save_interval:
            logger.error("step %d failed; saving the last complete step (%d) before stopping", self.step + 1, self.step)
            self._save_checkpoint()

    def _export_hf(self) -> None:
        from megatron_gkd.models import save_hf

        hf_dtype = self.config.checkpoint.hf_dtype
        with self.timers("hf_export"):
            save_hf(self.student.chunks, self.out / "hf" / f"step_{self.step}", dtype=hf_dtype and getattr(torch, hf_dtype),
                    tokenizer_source=self.config.student.tokenizer_path)

    def _on_signal(self, signum, frame) -> None:
        del frame
        if self._signal is not None:  # a second signal: stop now, as without a handler
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        logger.warning("signal %d received: the run checkpoints and stops after this step (send it again to stop "
                       "at once)", signum)
        self._signal = signum

    def _preempted(self) -> bool:
        flag = torch.tensor([self._signal or 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control)
        if flag.item():
            self._signal = int(flag.item())
        return bool(flag.item())

    # ------------------------------------------------------------------------------------------- end
    def _summary(self, first_eval: dict, last_eval: dict, start: float, preempted: bool = False) -> dict:
        summary = {"steps": self.step, "preempted": preempted, "wall_time_s": time.perf_counter() - start,
                   "final_loss": getattr(self, "last_metrics", {}).get("train/loss"),
                   "output_dir": str(self.out.resolve()),
                   "checkpoints": str((self.out / "checkpoints").resolve()),
                   "hf_export": str((self.out / "hf" / f"step_{self.step}").resolve()) if self.config.checkpoint.hf_at_end
                   and not preempted else None,
                   "metrics": str((self.out / "metrics.jsonl").resolve()),
                   # Each rank's peak resident set (libraries, a colocated engine and allocator caches included).
                   "peak_rss_gib_per_rank": [round(gib, 3) for gib in all_gather_msgpack(_peak_rss_gib(), self.control)]}
        for key in ("eval/accuracy", "eval/kl_to_teacher"):
            if key in first_eval:
                summary[f"{key}_before"] = first_eval[key]
            if key in last_eval:
                summary[f"{key}_after"] = last_eval[key]
        if self.rank == 0:
            logger.info("summary:\n%s", summary_table(summary))
        return summary

    def close(self) -> None:
        """Stops the engine, the teacher client and service, and the metric sinks (every rank)."""
        flow, teachers = getattr(self, "flow", None), getattr(self, "teachers", None)
        for name, action in (("progress", lambda: self.progress and self.progress.close()),
                             ("metrics", lambda: self.writer and self.writer.close()),
                             ("teacher clients", lambda: teachers and teachers.close_clients()),
                             ("rollout engine", lambda: flow and flow.engine and flow.engine.close()),
                             ("rollout server", lambda: flow and flow.remote and flow.remote.close()),
                             ("teacher services", lambda: teachers and teachers.stop_services())):
            try:
                action()
            except Exception:  # noqa: BLE001 - close everything else too
                logger.exception("closing the %s failed", name)
        parallel.destroy()


def _peak_rss_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _rss_gb() -> float:
    try:
        import psutil
    except ImportError:
        return float("nan")
    return psutil.Process().memory_info().rss / 2**30
