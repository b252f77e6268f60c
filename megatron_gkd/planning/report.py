"""Plans as text tables (for people, dry runs and logs) and as JSON-ready dicts (for tools)."""

from __future__ import annotations

import dataclasses

from megatron_gkd.planning.params import ParameterCounts
from megatron_gkd.planning.propose import Proposal
from megatron_gkd.planning.student import MemoryBreakdown, StudentPlan
from megatron_gkd.planning.teacher import TeacherPlan

GIB = 2**30
MAX_REJECTED_LINES = 12

_STUDENT_COLUMNS = (
    ("weights", "weights"),
    ("grads", "grads"),
    ("optimizer", "optim"),
    ("activations", "activ"),
    ("backward_workspace", "bwd ws"),
    ("teacher_topk", "top-k"),
    ("weight_sync", "wsync"),
)
# The hidden signal replaces the teacher's top-k with its hidden states, and adds the head and loss buffers.
_HIDDEN_SIGNAL_COLUMNS = (
    ("weights", "weights"),
    ("grads", "grads"),
    ("optimizer", "optim"),
    ("activations", "activ"),
    ("backward_workspace", "bwd ws"),
    ("teacher_hidden", "t-hidden"),
    ("teacher_head", "t-head"),
    ("hidden_loss", "hid-loss"),
    ("weight_sync", "wsync"),
)
_TEACHER_COLUMNS = (("weights", "weights"), ("kv_cache", "kv min"), ("workspace", "step ws"), ("teacher_topk", "top-k"))


def _billions(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [header] + rows) for i in range(len(header))]
    fmt = "  ".join("{:>%d}" % w for w in widths)
    return [fmt.format(*header)] + [fmt.format(*row) for row in rows]


def counts_line(counts: ParameterCounts) -> str:
    text = f"{_billions(counts.total)} parameters, {_billions(counts.activated)} activated"
    if counts.mtp:
        text += f"; MTP {_billions(counts.mtp)} more"
    return text


def student_table(plan: StudentPlan) -> str:
    batch = plan.batch
    lines = [
        f"student {plan.architecture} ({counts_line(plan.counts)})",
        f"  layout: {plan.layout.describe()}, {plan.layout.params_dtype}, {plan.layout.kernels} kernels",
        f"  batch: {batch.seq_length} tokens x micro-batch {batch.micro_batch_size} x {batch.num_microbatches} "
        "micro-batches, " + (f"top-k {batch.top_k}" if plan.teacher_head is None else "teacher hidden states")
        + f", loss {batch.loss}",
    ]
    if plan.teacher_head is not None:
        lines.append(f"  teacher head (hidden signal): {plan.teacher_head.describe()}")
    columns = _STUDENT_COLUMNS if plan.teacher_head is None else _HIDDEN_SIGNAL_COLUMNS
    header = ["stage", "layers", "params/dev"] + [title for _, title in columns] + ["total GiB"]
    rows = [
        [str(r.pp_rank), str(r.num_layers), _billions(r.parameters)]
        + [_gib(getattr(r.memory, name)) for name, _ in columns]
        + [_gib(r.memory.total)]
        for r in plan.ranks
    ]
    lines += ["  " + line for line in _table(header, rows)]
    lines += [f"  note: {note}" for note in plan.notes]
    return "\n".join(lines)


def teacher_table(plan: TeacherPlan) -> str:
    lines = [
        f"teacher {plan.architecture} ({counts_line(plan.counts)}), vLLM {plan.layout.describe()}, "
        f"{plan.weights_dtype} weights, {plan.layout.kv_cache_dtype} KV cache",
        f"  {plan.layout.num_devices} device(s), max_num_batched_tokens {plan.layout.max_num_batched_tokens}, "
        f"gpu_memory_utilization {plan.layout.gpu_memory_utilization:g}",
    ]
    header = ["stage", "layers", "params/dev"] + [t for _, t in _TEACHER_COLUMNS] + ["total GiB", "KV/token", "KV fits"]
    rows = [
        [str(r.pp_rank), str(r.num_layers), _billions(r.parameters)]
        + [_gib(getattr(r.memory, name)) for name, _ in _TEACHER_COLUMNS]
        + [_gib(r.memory.total), f"{r.kv_bytes_per_token / 1024:.1f} KiB"]
        + ["-" if r.kv_capacity_tokens is None else f"{r.kv_capacity_tokens} tok"]
        for r in plan.ranks
    ]
    lines += ["  " + line for line in _table(header, rows)]
    lines += [f"  note: {note}" for note in plan.notes]
    lines += [f"  DOES NOT FIT: {problem}" for problem in plan.problems]
    return "\n".join(lines)


def _rejected_lines(title: str, rejected: list) -> list[str]:
    if not rejected:
        return []
    lines = [f"{title} ({len(rejected)}):"]
    lines += [f"  {r.layout}: {r.reason}" for r in rejected[:MAX_REJECTED_LINES]]
    if len(rejected) > MAX_REJECTED_LINES:
        lines.append(f"  ... {len(rejected) - MAX_REJECTED_LINES} more (--json lists all)")
    return lines


def proposal_text(proposal: Proposal) -> str:
    usable = _gib(proposal.cluster.device.usable_bytes)
    lines = [f"cluster: {proposal.cluster.describe()}, {usable} GiB usable per device"]
    if proposal.teacher is not None:
        lines += ["", f"teacher on {proposal.teacher_devices} device(s):", teacher_table(proposal.teacher)]
    lines += _rejected_lines("smaller teacher layouts that fail", proposal.teacher_rejected)
    if proposal.student is not None:
        budget = _gib(proposal.student_budget_bytes)
        lines += ["", f"student on {proposal.student_devices} device(s), {budget} GiB each:", student_table(proposal.student)]
    lines += _rejected_lines("smaller student layouts that fail", proposal.student_rejected)
    lines += [f"PROBLEM: {problem}" for problem in proposal.problems]
    return "\n".join(lines)


def _memory_dict(memory: MemoryBreakdown) -> dict:
    return {**dataclasses.asdict(memory), "total": memory.total}


def to_dict(obj) -> dict:
    """A JSON-ready dict of a plan or proposal (bytes as integers; layouts and batches as fields)."""
    if isinstance(obj, (StudentPlan, TeacherPlan)):
        data = {
            "architecture": obj.architecture,
            "layout": dataclasses.asdict(obj.layout),
            "layout_summary": obj.layout.describe(),
            "counts": dataclasses.asdict(obj.counts),
            "ranks": [
                {**{k: v for k, v in vars(r).items() if k != "memory"}, "memory": _memory_dict(r.memory)}
                for r in obj.ranks
            ],
            "peak_bytes": obj.peak.memory.total,
            "notes": obj.notes,
        }
        if isinstance(obj, StudentPlan):
            data["batch"] = dataclasses.asdict(obj.batch)
            head = obj.teacher_head
            data["teacher_head"] = None if head is None else {
                **dataclasses.asdict(head), "teacher": head.teacher._asdict(), "shape": list(head.shape),
                "shard_bytes": head.shard_bytes, "loss_buffer_bytes": head.loss_buffer_bytes}
        else:
            data.update(weights_dtype=obj.weights_dtype, problems=obj.problems, feasible=obj.feasible)
            data["device"] = dataclasses.asdict(obj.device) if obj.device else None
        return data
    if isinstance(obj, Proposal):
        return {
            "cluster": dataclasses.asdict(obj.cluster),
            "batch": dataclasses.asdict(obj.batch),
            "teacher": to_dict(obj.teacher) if obj.teacher else None,
            "teacher_devices": obj.teacher_devices,
            "teacher_rejected": [dataclasses.asdict(r) for r in obj.teacher_rejected],
            "student": to_dict(obj.student) if obj.student else None,
            "student_devices": obj.student_devices,
            "student_rejected": [dataclasses.asdict(r) for r in obj.student_rejected],
            "student_budget_bytes": obj.student_budget_bytes,
            "problems": obj.problems,
        }
    if isinstance(obj, ParameterCounts):
        return dataclasses.asdict(obj)
    raise TypeError(f"cannot report a {type(obj).__name__}")
