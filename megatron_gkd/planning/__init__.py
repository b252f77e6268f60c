"""Memory and topology planner: parameter counts, per-device memory, layouts that fit a cluster.

Pure Python on plain inputs (HF ``config.json`` dicts and dataclasses): no torch, no Megatron-Core, so
dry runs print plans on a laptop. Supported architectures: Llama, Qwen2, Qwen3, Qwen3-MoE and
DeepSeek-V3 (multi-latent attention, shared experts, MTP layers, FP8 block-quantised checkpoints)::

    from megatron_gkd import planning

    hf = planning.read_config("configs/hf/qwen3-30b-a3b")
    counts = planning.count_parameters(planning.model_shape(hf))        # total / activated / MTP
    batch = planning.Batch(seq_length=8192, micro_batch_size=1, num_microbatches=8, top_k=64)
    layout = planning.StudentLayout(tensor_model_parallel_size=2, expert_model_parallel_size=8,
                                    data_parallel_size=8, sequence_parallel=True,
                                    use_distributed_optimizer=True)
    plan = planning.plan_student(hf, layout, batch, planning.WeightSync())
    table = planning.student_table(plan)                                # one row per pipeline stage
    # teacher.signal=hidden: the last stage also holds the teacher's output-layer shard
    head = planning.read_teacher_head("configs/hf/deepseek-v3")            # (vocab, hidden, tied), no weights
    plan = planning.plan_student(hf, layout, batch, planning.WeightSync(), teacher_head=head)

    teacher = planning.plan_teacher(planning.read_config("configs/hf/deepseek-v3"),
                                    planning.TeacherLayout(tensor_parallel_size=8, pipeline_parallel_size=2),
                                    batch, planning.get_device("h100-80gb"))
    cluster = planning.Cluster(nodes=4, devices_per_node=8, device=planning.get_device("h100-80gb"))
    proposal = planning.propose(hf, cluster, batch, teacher_hf=planning.read_config("configs/hf/deepseek-v3"))
    text, data = planning.proposal_text(proposal), planning.to_dict(proposal)  # table, JSON-ready dict

The command line is ``python -m megatron_gkd.planning {params,student,teacher,propose}``. How each
number is computed, what is and is not counted, and how the model was checked against measured peaks
is in ``docs/scaling.md``.
"""

from megatron_gkd.planning.cluster import DEVICES, Cluster, Device, get_device
from megatron_gkd.planning.layout import Batch, StudentLayout, TeacherLayout, WeightSync
from megatron_gkd.planning.model import ModelShape, model_shape, read_config
from megatron_gkd.planning.params import ParameterCounts, count_parameters
from megatron_gkd.planning.propose import Proposal, propose
from megatron_gkd.planning.report import proposal_text, student_table, teacher_table, to_dict
from megatron_gkd.planning.student import MemoryBreakdown, StudentPlan, plan_student
from megatron_gkd.planning.teacher import TeacherPlan, plan_teacher
from megatron_gkd.planning.teacher_head import TeacherHeadPlan, TeacherHeadShape, plan_teacher_head, read_teacher_head

__all__ = [
    "DEVICES",
    "Batch",
    "Cluster",
    "Device",
    "MemoryBreakdown",
    "ModelShape",
    "ParameterCounts",
    "Proposal",
    "StudentLayout",
    "StudentPlan",
    "TeacherHeadPlan",
    "TeacherHeadShape",
    "TeacherLayout",
    "TeacherPlan",
    "WeightSync",
    "count_parameters",
    "get_device",
    "model_shape",
    "plan_student",
    "plan_teacher",
    "plan_teacher_head",
    "propose",
    "proposal_text",
    "read_config",
    "read_teacher_head",
    "student_table",
    "teacher_table",
    "to_dict",
]
