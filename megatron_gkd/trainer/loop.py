"""The distillation trainer: ``Trainer(config).train()`` under torchrun (SPMD: every rank runs it).

One step reads ``rollout -> teacher -> student forward/backward -> optimizer -> weight sync -> log /
eval / checkpoint``; each phase is a method with a named timer. The scheduler (:mod:`.schedulers`)
decides how far batch production runs ahead of the update that trains it.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from megatron_gkd import parallel, platform
from megatron_gkd.config import GKDConfig, check_layout, eval_enabled, needs_responses, needs_teacher, to_dict, to_yaml
from megatron_gkd.config.checkpoints import check_checkpoints
from megatron_gkd.config.schema import MODES
from megatron_gkd.data import PromptSampler, load_prompts, load_tokenizer
from megatron_gkd.data.tokenization import stop_token_ids
from megatron_gkd.parallel.comm import all_gather_msgpack, broadcast_msgpack
from megatron_gkd.trainer import engine_check, run_dir, specs
from megatron_gkd.trainer import metrics as run_metrics
from megatron_gkd.trainer.checkpointing import RunCheckpoints
from megatron_gkd.trainer.components import build_rollout, build_student, teacher_check
from megatron_gkd.trainer.eval import Evaluator, TeacherKL
from megatron_gkd.trainer.flow import BatchFlow, InFlight
from megatron_gkd.trainer.metrics import MetricsWriter, Progress, Timers, batch_metrics, loss_metrics
from megatron_gkd.trainer.preemption import Preemption
from megatron_gkd.trainer.routing import RoutingStats
from megatron_gkd.trainer.schedulers import BatchPipeline
from megatron_gkd.trainer.step import StepRunner
from megatron_gkd.trainer.teachers import Teachers

logger = logging.getLogger(__name__)


class Trainer:
    """Builds every part of a run from ``config`` and trains (call after ``platform.setup()``)."""

    def __init__(self, config: GKDConfig):
        self.config = config
        self.out = run_dir.root(config)
        self.timers = Timers()
        self.step = 0
        self.tokens_trained = 0  # response tokens of the trained batches (trainer.token_budget)
        self.writer = self.progress = self.rollout = self.evaluator = self.flow = None
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
            self.flow.annotations.wait_ready()  # the reward worker started with the flow (a no-op without rewards)
        with phase("resume"):
            self._resume()
        startup = run_metrics.startup_metrics(phase.pop())
        self._open_sinks()
        if self.writer is not None:
            self.writer.carry(startup)  # on the first record
        self.preemption = Preemption(self.control)

    def _build_student(self) -> None:
        config = self.config
        self.student = build_student(config, self.state)
        self.teachers.build_local_parts(self.state, self.student, self.tokenizer)
        self.runner = StepRunner(self.student.chunks, self.student.optimizer, self.student.lr_scheduler,
                                 tp_group=self.state.tp_group, dp_group=self._dp_gloo, dp_size=self.state.data_parallel_size,
                                 is_last_stage=self.state.is_pipeline_last_stage,
                                 teacher_heads={t.name: t.head for t in self.teachers if t.head is not None},
                                 policy=specs.PolicySpec.from_config(config, len(self.tokenizer)), averages=self.teachers.averages)
        self.routing = RoutingStats(self.student.chunks, self.control, data_parallel_size=self.state.data_parallel_size) \
            if self.student.is_moe else None
        self.loss_spec = specs.loss_specs(config.loss, config.trainer.run_mode, self.teachers, len(self.tokenizer))
        self.checkpoints = RunCheckpoints(config, self.out, self.student, self.state, self.timers, extra_models=self.teachers.checkpointed)

    # ----------------------------------------------------------------------------------------- setup
    def _setup_process(self) -> None:
        config = self.config
        if config.trainer.deterministic:
            platform.use_deterministic_algorithms()
        self.state = parallel.initialize(config.parallel)
        parallel.seed(config.trainer.seed)
        self.rank, self.world_size = self.state.rank, self.state.world_size
        self.control = self.state.control_group  # agreement, metrics, batches: host memory whatever the device
        self._dp_gloo = self.state.dp_gloo_group
        self.layout = check_layout(config, self.world_size)
        logger.info("checkpoints (--dry-run's checks, done first):\n  %s", "\n  ".join(check_checkpoints(config, self.world_size)))
        last = torch.tensor([self.rank if self.state.is_pipeline_last_stage else -1])
        dist.all_reduce(last, op=dist.ReduceOp.MAX, group=self.control)
        self._metrics_rank = int(last)  # a last-stage rank: it holds the step's loss statistics
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            run_dir.config_file(self.out).write_text(to_yaml(config))
        logger.info("run directory %s: %d ranks, data parallel %d, %d prompts (%d samples) per step", self.out, self.world_size,
                    self.layout["data_parallel_size"], self.layout["prompts_per_step"], config.trainer.global_batch_size)

    def _start_teacher_service(self) -> None:
        self.teachers = Teachers(self.config)
        if needs_teacher(self.config) or eval_enabled(self.config):
            self.teachers.start_services(self.rank, self.out, self.control)

    def _load_data(self) -> None:
        config, data = self.config, self.config.data
        self.tokenizer = load_tokenizer(config.student.tokenizer_path)
        self.stop_ids = stop_token_ids(config.rollout.stop_token_ids, self.tokenizer)
        show, keep = self.rank == 0, self.teachers.keep_conversations
        self.train_data = load_prompts(data.train_path, data, self.tokenizer, show_progress=show,
                                       require_responses=needs_responses(config), keep_conversations=keep)
        self.eval_data, self._eval_groups = None, {}
        if eval_enabled(config):
            self.eval_data = load_prompts(data.eval_path, data, self.tokenizer, show_progress=show,
                                          limit=data.num_eval_prompts, keep_conversations=keep)
            self._eval_groups = {record.index: record.group for record in self.eval_data}
        if self.teachers.several and self.teachers.routed:  # every record must reach a teacher
            for dataset in filter(None, (self.train_data, self.eval_data)):
                self.teachers.assign(sorted({record.group for record in dataset}, key=str))
        self.sampler = PromptSampler(len(self.train_data), self.layout["prompts_per_step"], shuffle=data.shuffle,
                                     seed=data.seed)

    def _connect_teacher(self) -> None:
        config = self.config
        if needs_teacher(config) or (eval_enabled(config) and config.eval.kl and len(self.teachers)):
            check = teacher_check(config, self.tokenizer, self.student.vocab_size, self.flow.exchange.tcad)
            self.teachers.connect(self.state, self.flow.exchange.asks, check)

    def _build_rollout(self) -> None:
        config = self.config
        self.rollout = build_rollout(config, self.student, self.tokenizer, control=self.control, out=self.out,
                                     layout=self.layout, stop_ids=self.stop_ids, timers=self.timers)
        self.flow = BatchFlow(config, self.state, control=self.control, dp_group=self._dp_gloo, tokenizer=self.tokenizer,
                              timers=self.timers, teachers=self.teachers, rollout=self.rollout, stop_ids=self.stop_ids)
        self.teachers.learn_prompts([d for d in (self.train_data, self.eval_data) if d is not None], self.flow.exchange.asks)
        if self.eval_data is not None:
            kl = None
            if config.eval.kl and len(self.teachers):  # scored as the distillation modes score, in every mode
                scored = specs.loss_specs(config.loss, MODES["off_policy"], self.teachers, len(self.tokenizer))
                kl = TeacherKL(self.flow, self.runner, {name: spec.eval_kl() for name, spec in scored.items()},
                               self._eval_groups, self.control, self._metrics_rank)
            self.evaluator = Evaluator(self.eval_data, self.tokenizer, self.rollout.generate, kl, config.eval,
                                       self.stop_ids)

    def _resume(self) -> None:
        loaded = self.checkpoints.resume()
        if loaded is None:
            return
        self.step, sampler_state, self.tokens_trained = loaded
        self.sampler.load_state_dict(self.flow.restore(sampler_state))  # partial rollouts: their buffer too
        logger.info("resumed at step %d (data epoch %d)", self.step, self.sampler.epoch)
        if self.step:
            self._sync_weights()

    def _open_sinks(self) -> None:
        if self.rank != 0:
            return
        self.writer = MetricsWriter(self.out, self.config.logging, resume_step=self.step, run_config=to_dict(self.config))
        self.progress = Progress(self.config.trainer.num_steps, self.step, self.config.logging)

    # ------------------------------------------------------------------------------------------ train
    def train(self) -> dict:
        """Trains to ``trainer.num_steps`` (or a preemption signal); returns the run's summary."""
        config, start = self.config, time.perf_counter()
        first_eval = self._evaluate() if config.eval.at_start and self.step == 0 else {}
        if first_eval and self.rank == 0:
            self.writer.write(self.step, {**first_eval, **{f"time/{k}": v for k, v in self.timers.pop().items()}})
            self.progress.evaluated(first_eval)
        self.pipeline = BatchPipeline(self._produce, max_staleness=config.trainer.schedule.max_staleness, start=self.step,
                                      num_batches=config.trainer.num_steps)
        metrics: dict = {}
        clock = time.perf_counter()
        while not self._finished():
            _, batch = self.pipeline.next()
            try:
                metrics = self._update(batch)
            except Exception:
                self.checkpoints.save_after_failure(self.step, batch.data_state, self.tokens_trained)  # resumes at it
                raise
            self.step += 1
            self._sync_weights()
            if config.eval.interval and self.step % config.eval.interval == 0 and not self._finished():
                metrics.update(self._evaluate())
            now = time.perf_counter()
            metrics["time/step"], clock = now - clock, now  # wall time since the previous step's end
            self._log(metrics)
            engine_check.check(self.last_metrics, tolerance=engine_check.tolerance_of(config), step=self.step)
            self._checkpoint_if_due()
            if self.preemption.requested():
                self._save_checkpoint()
                logger.warning("stopped by signal %s after step %d; checkpoint saved: rerun the same command to "
                               "resume", self.preemption.signal, self.step)
                return self._summary(first_eval, {}, start, preempted=True)
        if self.step < config.trainer.num_steps:
            logger.info("token budget of %d reached after step %d (%d tokens trained); %d batches sampled ahead are not "
                        "trained", config.trainer.token_budget, self.step, self.tokens_trained, len(self.pipeline.in_flight))
        last_eval = self._evaluate() if config.eval.at_end else {}
        if last_eval and self.rank == 0:
            self.writer.write(self.step, last_eval)
        if config.checkpoint.save_at_end:
            self._save_checkpoint()
        if config.checkpoint.hf_at_end:
            self.checkpoints.export_hf(self.step)
        return self._summary(first_eval, last_eval, start)

    def _finished(self) -> bool:
        """``trainer.num_steps`` done, or ``trainer.token_budget`` spent."""
        budget = self.config.trainer.token_budget
        return self.step >= self.config.trainer.num_steps or (budget is not None and self.tokens_trained >= budget)

    def _produce(self, index: int) -> InFlight:
        """Draws the prompts of batch ``index``, samples (or reads) responses, sends the teacher request."""
        def draw(count: int | None = None) -> list:  # the next prompts (a step's; partial rollouts ask for fewer)
            return [self.train_data[position] for position in self.sampler.next_batch(count)]
        return self.flow.produce_batch(index, draw, self.flow.data_state(self.sampler.state_dict()), version=self.step)

    def _update(self, batch: InFlight) -> dict:
        """Waits for the batch and its teacher rows, runs forward/backward over its micro-batches, steps the optimizer."""
        prepared = self.flow.prepare(batch)
        if self.rollout is not None:
            self.rollout.release()  # the engine may read the weights the optimizer is about to change
        with self.timers("train"):
            stats, optim = self.runner.train_step(self.loss_spec, prepared.microbatches)
        self.tokens_trained += batch.rollout.num_generated_tokens  # the whole global batch, the same on every rank
        metrics = batch_metrics(batch.rollout, self.timers.pop(), step=self.step, tokens_trained=self.tokens_trained,
                                epoch=self.sampler.epoch, batches_sampled=self.pipeline.num_sampled)
        metrics["prompts"] = batch.prompt_indices
        metrics.update({f"train/{key}": value for key, value in optim.items()})
        if self.routing is not None:  # MoE: load-balancing loss and expert load (collective)
            metrics.update(self.routing.collect(len(prepared.microbatches)))
        if stats is not None:
            metrics.update(loss_metrics(stats, self.teachers.names if self.teachers.several else None))
            metrics.update(prepared.confidence)
        metrics.update(prepared.metrics)
        return metrics

    def _sync_weights(self, force: bool = False) -> None:
        """Puts weights version ``self.step`` into the rollout engine (see :meth:`Rollout.sync`)."""
        if self.rollout is not None:
            self.rollout.sync(self.student.chunks, self.step, force=force)

    def _log(self, metrics: dict) -> None:
        with self.timers("log"):
            metrics = broadcast_msgpack(metrics if self.rank == self._metrics_rank else None, self._metrics_rank,
                                        self.control)
        self.last_metrics = metrics
        if self.rank == 0:
            self.writer.write(self.step, metrics)
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

    # ------------------------------------------------------------------------------------ checkpoints
    def _data_position(self) -> tuple[dict, int]:
        """Where the data resumes (the sampler's state) and the tokens trained so far."""
        in_flight = self.pipeline.in_flight if hasattr(self, "pipeline") else []
        # Batches sampled but not trained are re-sampled after a resume: the position is the oldest one's.
        return (in_flight[0][1].data_state if in_flight else self.flow.data_state(self.sampler.state_dict())), \
            self.tokens_trained

    def _save_checkpoint(self) -> None:
        self.checkpoints.save(self.step, *self._data_position())

    def _checkpoint_if_due(self) -> None:
        save, export = self.checkpoints.due(self.step) if not self._finished() else (False, False)
        if save:
            self._save_checkpoint()
        if export:
            self.checkpoints.export_hf(self.step)

    # ------------------------------------------------------------------------------------------- end
    def _summary(self, first_eval: dict, last_eval: dict, start: float, preempted: bool = False) -> dict:
        summary = run_metrics.run_summary(
            steps=self.step, preempted=preempted, wall_time_s=time.perf_counter() - start,
            final_loss=getattr(self, "last_metrics", {}).get("train/loss"), out=self.out,
            hf_export=self.config.checkpoint.hf_at_end, first_eval=first_eval, last_eval=last_eval,
            peak_rss_per_rank=all_gather_msgpack(platform.peak_rss_gib(), self.control))
        if self.rank == 0:
            logger.info("summary:\n%s", run_metrics.summary_table(summary))
        return summary

    def close(self) -> None:
        """Stops the engine, the teacher client and service, and the metric sinks (every rank)."""
        teachers = getattr(self, "teachers", None)
        for name, action in (("progress", lambda: self.progress and self.progress.close()),
                             ("metrics", lambda: self.writer and self.writer.close()),
                             ("teacher clients", lambda: teachers and teachers.close_clients()),
                             ("annotators", lambda: self.flow and self.flow.annotations.close()),
                             ("rollout", lambda: self.rollout and self.rollout.close()),
                             ("teacher services", lambda: teachers and teachers.stop_services())):
            try:
                action()
            except Exception:  # noqa: BLE001 - close everything else too
                logger.exception("closing the %s failed", name)
        parallel.destroy()

