"""From a step's prompts to its micro-batches: sampling (the colocated engine or the rollout server), this
rank's teacher request, and the teacher rows and loss coefficients each micro-batch carries.

Every rank runs the same calls in the same order (they are collectives on the control group, the TP
group or the rollout server's group); a failure on one rank (a teacher past its deadline) stops every
rank at the same point (:func:`megatron_gkd.parallel.comm.agree`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.distributed as dist

from megatron_gkd import platform
from megatron_gkd.config import needs_teacher
from megatron_gkd.parallel.comm import agree, all_gather_msgpack, broadcast_msgpack
from megatron_gkd.rollout.types import RolloutBatch, concat_batches, decode_batch, encode_batch
from megatron_gkd.trainer.batch import (TCADSpec, TeacherRows, build_microbatch, common_shape, plan_microbatches,
                                        samples_from_rollout, score_batch, teacher_rows, token_coefficients)


@dataclasses.dataclass
class InFlight:
    """A batch on its way to the update that trains it (see :mod:`.schedulers`).

    Attributes:
        index: the batch (= step) index.
        data_state: the sampler's state before this batch's prompts were drawn (resuming re-samples it).
        prompt_indices: dataset rows of the batch's prompts, in group order.
        rollout: the sampled batch (all samples of all data-parallel ranks).
        samples: this rank's data-parallel share.
        teacher: the future of this rank's teacher request (teacher ranks), or None.
        pending: disaggregated rollout: the future of ``(rollout, samples, teacher)`` from the rollout thread.
    """

    index: int
    data_state: dict
    prompt_indices: list[int]
    rollout: RolloutBatch | None
    samples: list | None
    teacher: object = None
    pending: object = None

    def resolve(self) -> None:
        """Waits for a rollout still running on the rollout server (a no-op otherwise)."""
        if self.pending is not None:
            self.rollout, self.samples, self.teacher = self.pending.result()
            self.pending = None


class BatchFlow:
    """Samples batches and turns them, with the teacher's rows, into micro-batches.

    Args:
        config: the run's config.
        state: the parallel state.
        control: a gloo group over every rank.
        dp_group: a gloo group over the data-parallel ranks.
        tokenizer: the student's tokenizer (vocabulary size, EOS, padding).
        stop_ids: ids that end a response.
        layout: :func:`megatron_gkd.config.check_layout`'s plan.
        timers: the trainer's phase timers.
        loss_kind: ``distill`` (teacher rows) or ``cross_entropy``.
        teacher_hidden_size: the teacher's hidden size with ``teacher.signal=hidden`` (the rows carry its
            hidden states), else None.
    The trainer attaches ``engine`` (colocated) or ``remote`` (rollout server) and ``client`` (teacher).
    """

    def __init__(self, config, state, *, control, dp_group, tokenizer, stop_ids, layout: dict, timers, loss_kind: str,
                 teacher_hidden_size: int | None = None):
        self.config, self.state, self.control, self.dp_group = config, state, control, dp_group
        self.tokenizer, self.stop_ids, self.layout, self.timers, self.loss_kind = tokenizer, stop_ids, layout, timers, loss_kind
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.rank = dist.get_rank()
        self.engine = self.remote = self.client = None
        self.local_teacher = config.teacher.client == "local"
        # One rank per TP group of the last stage asks a remote teacher and sends the rows to its TP group.
        self.is_teacher_rank = state.is_pipeline_last_stage and state.tp_rank == 0
        self.confidence: dict = {}
        self.teacher_hidden_size = teacher_hidden_size
        self.tcad = self._tcad_spec()

    # -------------------------------------------------------------------------------------- sampling
    def produce(self, index: int, records, data_state: dict, version: int) -> InFlight:
        """Samples (or reads) the responses of ``records`` and sends this rank's teacher request."""
        config = self.config
        prompt_indices = [record.index for record in records]
        if config.trainer.mode == "on_policy":
            prompts, sampling = [list(r.prompt_ids) for r in records], config.rollout.sampling(self._seed(index))
            if self.remote is not None:  # sampled on the rollout server while this rank trains
                pending = self.remote.submit(self._remote_batch, prompts, sampling, prompt_indices)
                return InFlight(index, data_state, prompt_indices, None, None, pending=pending)
            with self.timers("rollout"):
                rollout = self.generate(prompts, sampling)
        else:
            rollout = RolloutBatch.from_samples(
                prompts=[list(r.prompt_ids) for r in records], responses=[list(r.response_ids) for r in records],
                logprobs=[[0.0] * len(r.response_ids) for r in records], group_ids=range(len(records)),
                finish_reasons=["stop"] * len(records), weight_version=version, pad_token_id=self.pad_id)
        samples = self.my_samples(rollout, prompt_indices)
        teacher = None
        if needs_teacher(config) and (self.local_teacher or self.is_teacher_rank):
            with self.timers("teacher_send"):
                teacher = self.request(samples, self.tcad)
        return InFlight(index, data_state, prompt_indices, rollout, samples, teacher)

    def _remote_batch(self, prompts, sampling, prompt_indices):
        """On the rollout thread: the server's batch and this rank's teacher request for its share (a
        colocated Megatron teacher is a collective of the training ranks: it is asked in the update)."""
        rollout = self.remote.client.generate(prompts, self._with_stop_ids(sampling))
        samples = self.my_samples(rollout, prompt_indices)
        teacher = None
        if needs_teacher(self.config) and self.is_teacher_rank and not self.local_teacher:
            teacher = self.request(samples, self.tcad)
        return rollout, samples, teacher

    def _seed(self, index: int) -> int | None:
        seed = self.config.rollout.seed
        return None if seed is None else seed + index * 1_000_003

    def generate(self, prompts: list[list[int]], sampling) -> RolloutBatch:
        """Samples ``prompts`` (colocated engine or rollout server); every rank returns the same batch."""
        sampling = self._with_stop_ids(sampling)
        if self.remote is not None:
            return self.remote.generate(prompts, sampling)
        replicas = self.layout["rollout_replicas"] if not self.engine.shares_student_weights else 1
        if replicas == 1:
            batch = self.engine.generate(prompts, sampling)
            return decode_batch(broadcast_msgpack(encode_batch(batch) if self.rank == 0 else None, 0, self.control))
        # Each vLLM replica samples a block of prompts, seeded as one engine would seed them all.
        blocks = np.array_split(np.arange(len(prompts)), replicas)
        tp = self.config.rollout.tensor_parallel_size
        mine = blocks[self.rank // tp]
        seed = None if sampling.seed is None else sampling.seed + int(mine[0] if len(mine) else 0) * sampling.n
        batch = self.engine.generate([prompts[i] for i in mine], dataclasses.replace(sampling, seed=seed))
        gathered = all_gather_msgpack(encode_batch(batch), self.control)
        return concat_batches([decode_batch(gathered[r * tp]) for r in range(replicas)])

    def _with_stop_ids(self, sampling):
        return dataclasses.replace(sampling, stop_token_ids=tuple(sorted(set(sampling.stop_token_ids) | set(self.stop_ids))))

    def my_samples(self, rollout: RolloutBatch, prompt_indices: list[int]) -> list:
        """This data-parallel rank's samples: a contiguous block of whole prompt groups."""
        groups = np.array_split(np.arange(len(prompt_indices)), self.state.data_parallel_size)
        mine = set(groups[self.state.dp_rank].tolist())
        rows = [i for i in range(rollout.num_samples) if int(rollout.group_ids[i]) in mine]
        return samples_from_rollout(rollout, rows, prompt_indices)

    # --------------------------------------------------------------------------------------- teacher
    def _tcad_spec(self) -> TCADSpec | None:
        loss = self.config.loss
        if self.loss_kind != "distill" or loss.type != "tcad" or self.config.teacher.signal == "hidden":
            return None  # the hidden signal's support is the whole vocabulary
        width = loss.support_k or self.config.teacher.top_k
        if loss.support_mode == "union":
            width = self.config.teacher.top_k + self.config.rollout.logprobs_k
        return TCADSpec(support_k=width, mode=loss.support_mode)

    def request(self, samples, tcad: TCADSpec | None):
        """This rank's teacher request (a future); TCAD also asks for the student's top-k ids."""
        teacher = self.config.teacher
        batch = score_batch(samples, top_k=teacher.top_k, temperature=teacher.temperature,
                            vocab_size=len(self.tokenizer), request_student_topk=tcad is not None,
                            signal=teacher.signal, hidden_dtype=teacher.hidden_dtype)
        return self.client.score_async(batch)

    def teacher_outputs(self, future):
        """The teacher's outputs of this rank's request; every rank stops if any rank's request failed."""
        outputs, error = None, None
        with self.timers("teacher_wait"):
            if future is not None:
                try:
                    outputs = future.result()
                except Exception as caught:  # noqa: BLE001 - shared with every rank below
                    error = caught
            agree(error, self.control)
        return outputs

    def rows(self, samples, outputs, tcad: TCADSpec | None) -> TeacherRows | None:
        """The teacher rows of this rank's samples on the last stage (sent by the TP group's teacher
        rank); ``None`` elsewhere."""
        if not self.state.is_pipeline_last_stage:
            return None
        rows = teacher_rows(outputs, samples, tcad=tcad, vocab_size=len(self.tokenizer)) if outputs is not None else None
        if self.local_teacher or dist.get_world_size(self.state.tp_group) == 1:
            return rows
        total = sum(s.response_len for s in samples)
        hidden_size = self.teacher_hidden_size
        width = 0 if hidden_size else tcad.width if tcad else self.config.teacher.top_k
        device = platform.device()
        ids = rows.ids.to(device) if rows else torch.empty(total, width, dtype=torch.int64, device=device)
        logprobs = rows.logprobs.to(device) if rows else torch.empty(total, width, dtype=torch.float32, device=device)
        tokens = rows.token_logprobs.to(device) if rows else torch.empty(total, dtype=torch.float32, device=device)
        tensors = [ids, logprobs, tokens]
        if hidden_size:
            tensors.append(rows.hidden.to(device) if rows else
                           torch.empty(total, hidden_size, dtype=torch.float32, device=device))
        source = dist.get_global_rank(self.state.tp_group, 0)
        for tensor in tensors:
            dist.broadcast(tensor, src=source, group=self.state.tp_group)
        return TeacherRows(*(tensor.cpu() for tensor in tensors))

    def retries(self) -> float:
        """Teacher attempts retried so far, summed over the ranks that ask the teacher (collective)."""
        asks = self.client is not None and (self.is_teacher_rank or self.local_teacher)
        total = torch.tensor([self.client.num_retries if asks else 0], dtype=torch.float64)
        dist.all_reduce(total, group=self.control)
        return float(total)

    # -------------------------------------------------------------------------------- micro-batches
    def prepare(self, batch: InFlight) -> list:
        """Waits for the batch and its teacher rows, and cuts it into micro-batches."""
        with self.timers("rollout_wait"):
            batch.resolve()
        if batch.teacher is None and self.local_teacher and needs_teacher(self.config):
            batch.teacher = self.request(batch.samples, self.tcad)
        outputs = self.teacher_outputs(batch.teacher)
        with self.timers("batch"):
            rows = self.rows(batch.samples, outputs, self.tcad) if self.loss_kind == "distill" else None
            coefficients = self.coefficients(batch, rows)
            return self.microbatches(batch.samples, coefficients, rows)

    def coefficients(self, batch: InFlight, rows: TeacherRows | None) -> list[torch.Tensor]:
        """Each response token's share of the step's loss (see :mod:`.batch`), on the last stage."""
        samples, alpha = batch.samples, self.config.loss.confidence_alpha
        if not self.state.is_pipeline_last_stage:
            return [torch.zeros(s.response_len, dtype=torch.float64) for s in samples]
        total, groups = batch.rollout.num_generated_tokens, len(batch.prompt_indices)
        if alpha is None or rows is None:
            return token_coefficients(samples, total_tokens=total, num_groups=groups)
        token_logprobs = rows.token_logprobs.split([s.response_len for s in samples])
        coefficients = token_coefficients(samples, total_tokens=total, num_groups=groups,
                                          teacher_token_logprobs=token_logprobs, confidence_alpha=alpha)
        self.confidence = self._confidence_weights(samples, coefficients, groups)
        return coefficients

    def _confidence_weights(self, samples, coefficients, num_groups: int) -> dict:
        """Mean, max and entropy of TCAD's confidence weights per prompt group, over every DP rank."""
        groups: dict[int, list[float]] = {}
        for sample, coefficient in zip(samples, coefficients):
            groups.setdefault(sample.group, []).append(float(coefficient.sum()) * num_groups)
        totals = torch.zeros(3, dtype=torch.float64)  # sum of max weights, sum of entropies, groups
        for weights in groups.values():
            w = torch.tensor(weights, dtype=torch.float64)
            totals += torch.stack([w.max(), -(w * w.clamp_min(1e-30).log()).sum(), torch.tensor(1.0)])
        if self.state.data_parallel_size > 1:
            dist.all_reduce(totals, group=self.dp_group)
        count = max(float(totals[2]), 1.0)
        return {"train/confidence_weight_mean": 1.0 / self.config.rollout.n,
                "train/confidence_weight_max": float(totals[0]) / count,
                "train/confidence_weight_entropy": float(totals[1]) / count}

    def microbatches(self, samples, coefficients, rows: TeacherRows | None, *, labels: bool | None = None) -> list:
        """The micro-batches of ``samples`` (every rank of a pipeline plans the same cuts)."""
        trainer, parallel = self.config.trainer, self.config.parallel
        plan = plan_microbatches([s.input_len for s in samples], micro_batch_size=trainer.micro_batch_size,
                                 max_tokens=trainer.max_tokens_per_microbatch)
        per_sample = rows.split([s.response_len for s in samples]) if rows is not None else None
        multiple = parallel.tensor_model_parallel_size if parallel.sequence_parallel else 1
        labels = self.loss_kind == "cross_entropy" if labels is None else labels
        # Pipeline stages exchange activations of one shape per step (Megatron's variable_seq_lengths
        # refuses the allgather MoE dispatcher that the CPU needs): pad every micro-batch to it.
        shape = common_shape(samples, plan, multiple) if parallel.pipeline_model_parallel_size > 1 else None
        return [build_microbatch([samples[i] for i in indices], [coefficients[i] for i in indices], pad_multiple=multiple,
                                 rows=[per_sample[i] for i in indices] if per_sample else None, labels=labels,
                                 pad_token_id=self.pad_id, shape=shape) for indices in plan]
