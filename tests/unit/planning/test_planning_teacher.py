"""Teacher (vLLM) plans and cluster proposals for the common cases docs/scaling.md prints."""

import json
import pathlib

import pytest

from megatron_gkd.planning import Batch, Cluster, TeacherLayout, get_device, plan_teacher, propose, read_config
from megatron_gkd.planning.__main__ import main
from megatron_gkd.planning.teacher import vllm_stage_layers

CONFIGS = pathlib.Path(__file__).resolve().parents[3] / "configs" / "hf"
DEEPSEEK = read_config(CONFIGS / "deepseek-v3")
BATCH = Batch(seq_length=8192, micro_batch_size=1, num_microbatches=8)


def test_stage_layers_match_vllm():
    utils = pytest.importorskip("vllm.distributed.utils")
    for layers in (61, 48, 94, 36, 7):
        for pp in (1, 2, 3, 4, 5, 8):
            if pp <= layers:
                expected = [utils.get_pp_indices(layers, rank, pp) for rank in range(pp)]
                assert [(r.start, r.stop) for r in vllm_stage_layers(layers, pp)] == expected


def test_mla_cache_is_the_latent_on_every_tp_rank():
    for tp in (1, 8):
        plan = plan_teacher(DEEPSEEK, TeacherLayout(tensor_parallel_size=tp), BATCH)
        assert plan.ranks[0].kv_bytes_per_token == (512 + 64) * 61 * 2
    fp8_cache = plan_teacher(DEEPSEEK, TeacherLayout(tensor_parallel_size=8, kv_cache_dtype="fp8"), BATCH)
    assert fp8_cache.ranks[0].kv_bytes_per_token == 576 * 61


def test_gqa_cache_splits_heads_and_replicates_when_tp_exceeds_them():
    qwen = read_config(CONFIGS / "qwen3-8b")  # 8 key/value heads of 128, 36 layers
    kv = {tp: plan_teacher(qwen, TeacherLayout(tensor_parallel_size=tp), BATCH).ranks[0].kv_bytes_per_token for tp in (1, 4, 16)}
    assert kv == {1: 2 * 8 * 128 * 36 * 2, 4: 2 * 2 * 128 * 36 * 2, 16: 2 * 1 * 128 * 36 * 2}


def test_fp8_weights_halve_deepseek_v3_and_need_two_h100_nodes():
    h100 = get_device("h100-80gb")
    fp8 = plan_teacher(DEEPSEEK, TeacherLayout(tensor_parallel_size=8), BATCH, h100)
    bf16 = plan_teacher(DEEPSEEK, TeacherLayout(tensor_parallel_size=8, weights_dtype="bf16"), BATCH, h100)
    assert fp8.weights_dtype == "fp8"
    assert 0.5 < fp8.ranks[0].memory.weights / bf16.ranks[0].memory.weights < 0.52
    assert not fp8.feasible and "GiB budget" in fp8.problems[0]
    two_nodes = plan_teacher(DEEPSEEK, TeacherLayout(tensor_parallel_size=8, pipeline_parallel_size=2), BATCH, h100)
    assert two_nodes.feasible and all(rank.kv_capacity_tokens > 8 * 8192 for rank in two_nodes.ranks)
    assert plan_teacher(DEEPSEEK, TeacherLayout(tensor_parallel_size=8), BATCH, get_device("h200-141gb")).feasible


def test_ascend_serves_the_fp8_checkpoint_in_bf16_or_int8():
    ascend = get_device("ascend-910b-64gb")
    plan = plan_teacher(DEEPSEEK, TeacherLayout(tensor_parallel_size=8, pipeline_parallel_size=4), BATCH, ascend)
    assert plan.weights_dtype == "bf16" and any("int8" in note for note in plan.notes)
    with pytest.raises(ValueError, match="no FP8"):
        plan_teacher(DEEPSEEK, TeacherLayout(tensor_parallel_size=8, weights_dtype="fp8"), BATCH, ascend)


def test_prompt_logprob_logits_dominate_the_last_stage_workspace():
    small = plan_teacher(DEEPSEEK, TeacherLayout(tensor_parallel_size=8, max_num_batched_tokens=2048), BATCH)
    large = plan_teacher(DEEPSEEK, TeacherLayout(tensor_parallel_size=8, max_num_batched_tokens=8192), BATCH)
    logits = 6144 * 129280 * (2 + 4 + 4)
    assert large.ranks[0].memory.workspace - small.ranks[0].memory.workspace >= logits


def test_proposal_for_deepseek_teacher_and_qwen3_moe_student_on_h100_nodes():
    cluster = Cluster(nodes=4, devices_per_node=8, device=get_device("h100-80gb"))
    proposal = propose(read_config(CONFIGS / "qwen3-30b-a3b"), cluster, BATCH, teacher_hf=DEEPSEEK)
    assert not proposal.problems
    assert proposal.teacher.layout.describe() == "TP8 PP2" and proposal.teacher_devices == 16
    rejected = {r.layout: r.reason for r in proposal.teacher_rejected}
    assert "TP8 PP1" in rejected and "GiB budget" in rejected["TP8 PP1"]
    assert proposal.student_devices == 16
    assert proposal.student.peak.memory.total <= cluster.device.usable_bytes
    assert all("usable" in r.reason or "split" in r.reason for r in proposal.student_rejected)


def test_proposal_without_room_says_so():
    cluster = Cluster(nodes=1, devices_per_node=8, device=get_device("h100-80gb"))
    proposal = propose(read_config(CONFIGS / "qwen3-8b"), cluster, BATCH, teacher_hf=DEEPSEEK)
    assert proposal.teacher is None and "no teacher layout fits" in proposal.problems[0]


def test_cli_prints_tables_and_json(capsys):
    assert main(["params", "--hf", str(CONFIGS / "deepseek-v3")]) == 0
    assert "671.03 B parameters" in capsys.readouterr().out
    argv = ["propose", "--student", str(CONFIGS / "qwen3-8b"), "--teacher", str(CONFIGS / "deepseek-v3")]
    argv += ["--nodes", "2", "--device", "h200-141gb", "--seq-length", "8192", "--num-microbatches", "8"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "vLLM TP8 PP1" in text and "student on 8 device(s)" in text
    assert main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["teacher"]["layout"]["tensor_parallel_size"] == 8 and data["student_devices"] == 8
    assert main(["student", "--hf", str(CONFIGS / "qwen3-8b"), "--tp", "16"]) == 2
    assert "which do not split across tensor_model_parallel_size=16" in capsys.readouterr().err
