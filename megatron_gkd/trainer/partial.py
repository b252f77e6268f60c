"""Partial rollouts (``trainer.scheduler=partial``): a weight update does not stop generation.

Each step's rollout runs in rounds; a round gives every unfinished sample at most ``rollout.partial.chunk_tokens``
new tokens (one engine call). A sample that stops (EOS or a stop id) or reaches ``rollout.max_tokens`` in total is
complete; an unfinished one stays in the :class:`PartialBuffer` and the next round continues it from prompt + its
tokens so far. The rounds of a step run until ``P`` prompt groups are complete (all ``rollout.n`` samples of a
prompt: per-prompt statistics such as TCAD's confidence weights need the whole group); the step trains the ``P``
oldest and keeps the rest. A round first admits new prompts, as many as the step still lacks complete groups (never
past ``rollout.partial.max_prompts_in_flight``), and the first round as many more as there are unfinished groups (a
margin: a second round for a few prompts costs a chunk of decoding; a complete group past the step's waits for the
next): a long sample then costs the rounds it takes at the next steps, not a wait of this one. Samples carried over
a weight update continue with the new weights, and every response token records the version that sampled it
(``RolloutBatch.token_versions``), which the micro-batches carry to the loss.

Why chunks at step boundaries (slime's partial rollout) and not an engine that runs while the trainer steps (verl's
fully-async mode, AReaL): the colocated engine shares the training ranks, so it cannot run during an update; what
it can do is never wait for the slowest sample. The buffer is part of the checkpointed data position: a run killed
between steps resumes with the same unfinished samples, and every admitted group is trained exactly once (or is
still in the buffer).

:class:`PartialBuffer` is the bookkeeping (pure, no engine); :class:`PartialRollout` drives the engine with it.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from megatron_gkd.data.dataset import PromptRecord
from megatron_gkd.rollout.types import RolloutBatch

FINISHED = ("stop", "length")


@dataclasses.dataclass
class PartialSample:
    """One sample's response so far: its tokens, their raw log-probs, the weight version of each, top-k ids
    (TCAD; else None) and how it finished (None while unfinished)."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    topk: list[list[int]] | None = None
    finish: str | None = None


@dataclasses.dataclass
class PartialGroup:
    """The ``n`` samples of one admitted prompt; ``uid`` counts admissions over the run (a prompt drawn again in a
    later epoch is a new group)."""

    uid: int
    record: PromptRecord
    admitted: int
    samples: list[PartialSample]

    @property
    def complete(self) -> bool:
        return all(sample.finish is not None for sample in self.samples)


@dataclasses.dataclass(frozen=True)
class Work:
    """A sample to continue: ``(group position in the buffer, sample index)``, the ids the engine continues from,
    and its token budget this round."""

    group: int
    sample: int
    ids: list[int]
    budget: int


class PartialBuffer:
    """Prompt groups admitted and not yet trained, in admission order (identical on every rank).

    Args:
        n: samples per prompt (``rollout.n``).
        chunk_tokens: new tokens per sample and round.
        max_tokens: a response's length limit (``rollout.max_tokens``).
        capacity: groups held at most (complete or not).
    """

    def __init__(self, *, n: int, chunk_tokens: int, max_tokens: int, capacity: int):
        self.n, self.chunk_tokens, self.max_tokens, self.capacity = n, chunk_tokens, max_tokens, capacity
        self.groups: list[PartialGroup] = []
        self.next_uid = 0

    @property
    def num_complete(self) -> int:
        return sum(group.complete for group in self.groups)

    @property
    def room(self) -> int:
        return max(self.capacity - len(self.groups), 0)

    @property
    def num_unfinished_groups(self) -> int:
        return sum(not group.complete for group in self.groups)

    @property
    def num_unfinished_samples(self) -> int:
        return sum(sample.finish is None for group in self.groups for sample in group.samples)

    def admit(self, records, step: int) -> list[int]:
        """Adds a group of ``n`` empty samples per record; returns their uids."""
        assert len(self.groups) + len(records) <= self.capacity, "admitted past the buffer's capacity"
        uids = []
        for record in records:
            self.groups.append(PartialGroup(self.next_uid, record, step, [PartialSample() for _ in range(self.n)]))
            uids.append(self.next_uid)
            self.next_uid += 1
        return uids

    def pending(self) -> list[Work]:
        """Every unfinished sample, in buffer order, with what the engine continues from and its budget."""
        work = []
        for g, group in enumerate(self.groups):
            for s, sample in enumerate(group.samples):
                if sample.finish is None:
                    budget = min(self.chunk_tokens, self.max_tokens - len(sample.tokens))
                    work.append(Work(g, s, list(group.record.prompt_ids) + sample.tokens, budget))
        return work

    def extend(self, work: Work, tokens, logprobs, finish: str, version: int, topk=None) -> None:
        """Appends one round's tokens of ``work``'s sample (sampled by weights ``version``) and decides whether it is
        complete: stopped by the engine (``finish="stop"``) or at ``max_tokens``."""
        sample = self.groups[work.group].samples[work.sample]
        assert sample.finish is None, "a complete sample was continued"
        tokens, logprobs = list(tokens)[: work.budget], list(logprobs)[: work.budget]
        sample.tokens += tokens
        sample.logprobs += logprobs
        sample.versions += [int(version)] * len(tokens)
        if topk is not None:
            sample.topk = (sample.topk or []) + [list(row) for row in topk][: work.budget]
        if finish == "stop" and len(tokens) <= work.budget:
            sample.finish = "stop"
        elif len(sample.tokens) >= self.max_tokens:
            sample.finish = "length"

    def take(self, count: int) -> list[PartialGroup]:
        """Removes and returns the ``count`` oldest complete groups."""
        taken = [group for group in self.groups if group.complete][:count]
        assert len(taken) == count, f"{len(taken)} complete groups, {count} asked"
        uids = {group.uid for group in taken}
        self.groups = [group for group in self.groups if group.uid not in uids]
        return taken

    # ------------------------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict:
        """The buffer as plain types (the checkpoint's data position holds it)."""
        return {"next_uid": self.next_uid, "groups": [
            {"uid": g.uid, "admitted": g.admitted, "record": dataclasses.asdict(g.record),
             "samples": [dataclasses.asdict(s) for s in g.samples]} for g in self.groups]}

    def load_state_dict(self, state: dict) -> None:
        self.next_uid = int(state["next_uid"])
        self.groups = []
        for group in state["groups"]:
            record = dict(group["record"])
            record["prompt_ids"] = tuple(record["prompt_ids"])
            if record.get("response_ids") is not None:
                record["response_ids"] = tuple(record["response_ids"])
            samples = [PartialSample(**sample) for sample in group["samples"]]
            self.groups.append(PartialGroup(int(group["uid"]), PromptRecord(**record), int(group["admitted"]), samples))


def groups_batch(groups: list[PartialGroup], pad_token_id: int) -> RolloutBatch:
    """The trained groups as one batch (group ``i``'s samples are rows ``i*n ..``), with each token's version."""
    rows = [(g, group, sample) for g, group in enumerate(groups) for sample in group.samples]
    has_topk = any(sample.topk is not None for _, _, sample in rows)
    versions = [v for _, _, sample in rows for v in sample.versions]
    return RolloutBatch.from_samples(
        [group.record.prompt_ids for _, group, _ in rows], [sample.tokens for _, _, sample in rows],
        [sample.logprobs for _, _, sample in rows], [g for g, _, _ in rows], [sample.finish for _, _, sample in rows],
        weight_version=min(versions) if versions else 0, pad_token_id=pad_token_id,
        topk=[sample.topk or [] for _, _, sample in rows] if has_topk else None,
        versions=[sample.versions for _, _, sample in rows])


def token_staleness(rollout: RolloutBatch, step: int) -> torch.Tensor:
    """``[num tokens]`` the staleness of each response token when update ``step`` trains it."""
    return step - rollout.token_versions[rollout.response_mask]


class PartialRollout:
    """Samples a step's batch with the :class:`PartialBuffer` (see the module docstring).

    Args:
        config: the run's config.
        rollout: the run's :class:`~megatron_gkd.trainer.rollout_handle.Rollout` (every call is a collective).
        prompts_per_step: ``P``, the prompt groups a step trains.
        pad_id: the tokenizer's padding id.
    """

    def __init__(self, config, rollout, *, prompts_per_step: int, pad_id: int):
        partial = config.rollout.partial
        self.config, self.rollout, self.prompts_per_step, self.pad_id = config, rollout, prompts_per_step, pad_id
        capacity = max(partial.max_prompts_in_flight or 2 * prompts_per_step, prompts_per_step)
        self.buffer = PartialBuffer(n=config.rollout.n, chunk_tokens=partial.chunk_tokens,
                                    max_tokens=config.rollout.max_tokens, capacity=capacity)

    def sample(self, index: int, draw, version: int, seed: int | None) -> tuple[list[PartialGroup], dict]:
        """The groups batch ``index`` trains and its ``rollout/partial/*`` metrics (``draw(count)``: the next
        ``count`` prompt records; ``version``: the weights the engine holds; ``seed``: the batch's seed)."""
        buffer, start = self.buffer, time.perf_counter()
        admitted: list[int] = []
        generated = rounds = 0
        while buffer.num_complete < self.prompts_per_step:
            count = self.prompts_per_step - buffer.num_complete
            if not rounds:  # a margin for the groups that will not finish this round: a second round is rarer
                count += buffer.num_unfinished_groups
            count = min(count, buffer.room)
            if count:
                admitted += buffer.admit(draw(count), index)
            work = buffer.pending()
            assert work, "no complete group to train and none to continue"
            for budget in sorted({item.budget for item in work}, reverse=True):
                items = [item for item in work if item.budget == budget]
                round_seed = None if seed is None else seed + rounds * 10_007 + budget
                sampling = dataclasses.replace(self.config.rollout.sampling(round_seed), n=1, max_tokens=budget)
                batch = self.rollout.generate([item.ids for item in items], sampling)
                for i, item in enumerate(items):
                    buffer.extend(item, batch.response(i), batch.logprobs(i).tolist(), batch.finish_reasons[i], version,
                                  topk=None if batch.topk_ids is None else batch.topk(i).tolist())
                generated += batch.num_generated_tokens
            rounds += 1
        groups = buffer.take(self.prompts_per_step)
        seconds = time.perf_counter() - start
        metrics = {"rollout/partial/rounds": float(rounds), "rollout/partial/admitted": float(len(admitted)),
                   "rollout/partial/generated_tokens": float(generated),
                   "rollout/partial/tokens_per_s": generated / seconds if seconds > 0 else 0.0,
                   "rollout/partial/carried_samples": float(buffer.num_unfinished_samples),
                   "rollout/partial/waiting_groups": float(buffer.num_complete),
                   "rollout/partial/buffer_groups": float(len(buffer.groups)),
                   "rollout/partial/admitted_uids": admitted, "rollout/partial/trained_uids": [g.uid for g in groups]}
        return groups, metrics

    def state_dict(self) -> dict:
        return self.buffer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.buffer.load_state_dict(state)


def staleness_metrics(rollout: RolloutBatch, step: int, max_staleness: int | None) -> dict:
    """``rollout/partial/token_staleness_*`` of a trained batch and the tokens its bound masks out of the loss."""
    staleness = token_staleness(rollout, step).double()
    if not staleness.numel():
        return {}
    masked = 0 if max_staleness is None else int((staleness > max_staleness).sum())
    return {"rollout/partial/token_staleness_mean": float(staleness.mean()),
            "rollout/partial/token_staleness_max": float(staleness.max()),
            "rollout/partial/masked_tokens": float(masked)}
