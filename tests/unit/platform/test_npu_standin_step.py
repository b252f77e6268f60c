"""The npu platform end to end without Ascend hardware (issue #13's acceptance).

Stand-ins for ``torch_npu`` and ``mindspeed`` (``standins/``, put on the path of the processes started here
and nowhere else) make the registrations the real packages make, run on the host (HCCL groups are gloo
groups, the NPU's memory is host memory), and record every request made of them with the stack that made it.
Two runs under them:

* the real entry point (``megatron_gkd.trainer.cli``, what ``launch/pretrain_gkd.py`` runs, under torchrun, TP=2)
  trains one on-policy step: a tiny
  Megatron-Core student, the ``megatron`` rollout engine, a colocated Megatron teacher (``teacher.client=
  local`` with offload), the loss and the optimizer, with MindSpeed options in the config;
* weight sync over its own HCCL groups: a trainer process sends the student to a rollout process.

The records show which platform was set up, what MindSpeed received and when, and that every subsystem's
device and group requests go through ``megatron_gkd.platform``.
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch

from megatron_gkd import platform
from megatron_gkd.testing import runs

pytestmark = pytest.mark.distributed

STANDINS = pathlib.Path(__file__).resolve().parent / "standins"
RECORD_ENV = "TORCH_NPU_STANDIN_RECORD"
NPU = next(p for p in platform.known_platforms() if p.name == "npu")
PLATFORM_PACKAGE = "megatron_gkd/platform/"
# The device API of torch.npu (every other record is a placement, an HCCL group or an import).
DEVICE_API = {"is_available", "device_count", "current_device", "set_device", "synchronize", "manual_seed",
              "manual_seed_all", "get_rng_state", "set_rng_state", "empty_cache", "max_memory_allocated",
              "memory_allocated"}
MINDSPEED_OPTIONS = ["mindspeed.use_flash_attn=true", "mindspeed.use_fused_rmsnorm=true",
                     "mindspeed.use_fused_swiglu=true", "mindspeed.use_fused_rotary_pos_emb=true",
                     "mindspeed.optimization_level=1", "mindspeed.extra_args=[--use-cp-send-recv-overlap]"]
ONE_STEP = ["parallel.tensor_model_parallel_size=2", "teacher.client=local", "teacher.serve.model=null",
            "teacher.offload=true", "teacher.top_k=8", "rollout.engine=megatron", "rollout.n=2", "rollout.max_tokens=4",
            "trainer.scheduler=sync", "trainer.num_steps=1", "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
            "data.eval_path=null", "eval.at_start=false", "eval.at_end=false", "checkpoint.save_at_end=false",
            "checkpoint.hf_at_end=false", "checkpoint.save_interval=null", "logging.tensorboard=false"]


def read_records(directory: pathlib.Path) -> list[dict]:
    return [json.loads(line) for path in sorted(directory.glob("*.jsonl")) for line in path.read_text().splitlines()]


def origin(record: dict) -> str | None:
    """The innermost project file outside the platform package (and outside Megatron-Core) that asked."""
    for frame in reversed(record["stack"]):
        if not frame.startswith((PLATFORM_PACKAGE, "megatron/core/")):
            return frame
    return None


def asked_platform(records: list[dict]) -> set[str]:
    """The files whose device or group requests went through the platform package."""
    return {origin(r) for r in records if r["kind"] in DEVICE_API | {"hccl_group"}
            and any(frame.startswith(PLATFORM_PACKAGE) for frame in r["stack"])}


def assert_routed_through_platform(records: list[dict]) -> None:
    """Our code calls the device API only in the platform package (Megatron-Core's own calls, and torch's
    under it, are MindSpeed's to adapt; a library that asks it itself, as accelerate does when it is imported, is
    the library's caller, not ours); HCCL groups come from the platform package or from ``parallel``
    (the default group and Megatron-Core's groups, made with the platform's backend by ``parallel.initialize``)."""
    stray = [r for r in records if r["kind"] in DEVICE_API and not r["caller"].startswith("/")  # a library's own ask
             and not r["stack"][-1].startswith((PLATFORM_PACKAGE, "megatron/core/"))]
    assert not stray, stray[:3]
    groups = [r for r in records if r["kind"] == "hccl_group"]
    assert groups
    stray = [r for r in groups if not r["stack"][-1].startswith(PLATFORM_PACKAGE) and origin(r) != "parallel/state.py"]
    assert not stray, stray[:3]


@pytest.fixture(scope="module")
def student(tmp_path_factory) -> pathlib.Path:
    from megatron_gkd.recipes.tiny import build_checkpoint, build_tokenizer, write_prompts

    root = tmp_path_factory.mktemp("npu_assets")
    build_checkpoint(root / "student", hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256)
    build_tokenizer(root / "student")
    write_prompts(root / "train.jsonl", 16, seed=3)
    return root


@pytest.fixture(scope="module")
def step_run(student, tmp_path_factory):
    """One training step by the real entry point on the stand-in NPU; returns (records, log)."""
    out = tmp_path_factory.mktemp("npu_step") / "run"
    record_dir = out.parent / "records"
    record_dir.mkdir()
    overrides = [f"student.checkpoint={student / 'student'}", f"teacher.checkpoint={student / 'student'}",
                 f"data.train_path={student / 'train.jsonl'}", *ONE_STEP, *MINDSPEED_OPTIONS]
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(STANDINS), os.environ.get("PYTHONPATH")])),
           platform.PLATFORM_ENV: NPU.name, RECORD_ENV: str(record_dir)}
    process = runs.start(out, overrides, nproc=2, env=env)
    code = runs.wait(process, timeout_s=600)
    log = process.log_path.read_text(errors="replace")
    assert code == 0, log[-4000:]
    assert len(runs.steps(out)) == 1, log[-4000:]
    return read_records(record_dir), log


def test_step_sets_up_npu_with_hccl(step_run):
    records, log = step_run
    assert f"platform: {NPU.name} (distributed backend {NPU.dist_backend})" in log
    assert {r["rank"] for r in records if r["kind"] == "import_torch_npu"} == {"0", "1"}
    # The default group is an HCCL group (the stand-in's), made from the platform's backend name.
    default_groups = [r for r in records if r["kind"] == "hccl_group" and "megatron/core/parallel_state.py" not in r["stack"]
                      and origin(r) == "parallel/state.py"]
    assert {r["rank"] for r in default_groups} == {"0", "1"}
    megatron_groups = [r for r in records if r["kind"] == "hccl_group" and "megatron/core/parallel_state.py" in r["stack"]]
    assert {r["rank"] for r in megatron_groups} == {"0", "1"}  # Megatron-Core's groups take the default backend
    assert {r["detail"]["index"] for r in records if r["kind"] == "set_device"} == {0, 1}


def test_mindspeed_gets_the_configured_options_before_megatron(step_run):
    records, _ = step_run
    adaptors = [r for r in records if r["kind"] == "mindspeed_adaptor"]
    assert len(adaptors) == 2  # one per rank
    for adaptor in adaptors:
        assert adaptor["detail"]["megatron_imported_before"] == []
        assert adaptor["stack"][-2:] == ["megatron_gkd/platform/__init__.py", "megatron_gkd/platform/npu.py"]
        assert adaptor["stack"][0] == "megatron_gkd/trainer/cli.py"  # launch/pretrain_gkd.py's logic, run with torchrun -m
        args = adaptor["detail"]["args"]
        assert args["use_flash_attn"] is True and args["use_fused_rmsnorm"] is True
        assert args["use_fused_swiglu"] is True and args["use_fused_rotary_pos_emb"] is True
        assert args["optimization_level"] == 1 and args["use_cp_send_recv_overlap"] is True
        assert args["context_parallel_algo"] == "megatron_cp_algo"
        # The model-describing flags MindSpeed's fused kernels check, and none of the trainer's own arguments.
        assert args["normalization"] == "RMSNorm" and args["swiglu"] is True and args["position_embedding_type"] == "rope"
        assert "config" not in args and not any("=" in str(arg) for arg in adaptor["detail"]["argv"][1:])


def test_every_subsystem_asks_the_platform_for_its_devices_and_groups(step_run):
    records, _ = step_run
    assert_routed_through_platform(records)
    asked = asked_platform(records)
    # The trainer: its process, device, seeds and groups (parallel.initialize), timers and memory metrics
    # (metrics.py: the step's records are assembled there, not in loop.py).
    assert {"parallel/state.py", "megatron_gkd/trainer/metrics.py"} <= asked
    assert "models/builder.py" in asked  # where the student's weights are initialised
    # The colocated teacher: its device, and the offload's synchronize / empty_cache.
    assert "megatron_gkd/teacher/clients/local.py" in asked
    assert {"synchronize", "empty_cache"} <= {r["kind"] for r in records if origin(r) == "megatron_gkd/teacher/clients/local.py"}
    # The rollout engine asks for the device of its token batches.
    assert "megatron_gkd/rollout/megatron_engine.py" in asked


def _weight_sync_rank(path: str, ports: tuple[int, int]):
    """Trainer rank 0 sends the student it loaded; rollout rank 1 receives it (separate jobs, as in a run)."""
    from megatron_gkd import parallel
    from megatron_gkd.models import load_hf
    from megatron_gkd.testing.weight_sync import RecordingEngine
    from megatron_gkd.weight_sync import (
        TorchDistributedTransport,
        WeightReceiver,
        WeightSender,
        WeightSyncConfig,
        build_plan,
        connect_rollout,
        connect_trainer,
    )

    rank = int(os.environ["RANK"])
    transport = TorchDistributedTransport(address="127.0.0.1", port=ports[0], rank=rank, num_trainer_ranks=1,
                                          num_rollout_ranks=1, timeout_s=120)
    config = WeightSyncConfig()
    if rank == 0:
        # The trainer's world of one, its default group made by parallel.initialize as in a run.
        os.environ.update(WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_PORT=str(ports[1]))
        parallel.initialize()
        chunks = load_hf(path)
        plan = build_plan(chunks)
        connect_trainer(plan, transport)
        WeightSender(plan, transport, config).sync(chunks, version=1)
        transport.close()
        # What weight_sync's verify compares with vLLM: the student's own prompt log-probs (forward_logits).
        from megatron_gkd.weight_sync.verify import student_prompt_logprobs

        return transport.backend, student_prompt_logprobs(chunks, [[1, 2, 3, 4]])
    plan = connect_rollout(transport)
    engine = RecordingEngine()
    version = WeightReceiver(plan, transport, config).sync(engine)
    transport.close()
    return version, engine.weights


def test_weight_sync_asks_the_platform_for_hccl_groups_and_its_device(student, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from megatron_gkd.testing.distributed import free_port, run_distributed

    record_dir = tmp_path / "records"
    record_dir.mkdir()
    # The children inherit the path (spawn); the stand-ins are imported only by their platform.setup(npu).
    monkeypatch.syspath_prepend(str(STANDINS))
    (backend, verify_logprobs), (version, received) = run_distributed(
        _weight_sync_rank, 2, args=(str(student / "student"), (free_port(), free_port())), platform_name=NPU.name,
        init_process_group=False, env={RECORD_ENV: str(record_dir)}, timeout=600)
    assert backend == NPU.dist_backend and version == 1
    reference = load_file(student / "student" / "model.safetensors")
    assert set(received) == set(reference)
    for name, tensor in reference.items():
        torch.testing.assert_close(received[name], tensor, rtol=0, atol=0, msg=name)
    records = read_records(record_dir)
    assert_routed_through_platform(records)
    transports = [r for r in records if origin(r) == "megatron_gkd/weight_sync/transports.py"]
    assert {r["rank"] for r in transports if r["kind"] == "hccl_group"} == {"0", "1"}  # both sides' bucket groups
    assert {r["rank"] for r in transports if r["kind"] == "current_device"} == {"0", "1"}  # both sides' buffers
    assert any(r["kind"] == "place" and origin(r).startswith("megatron_gkd/weight_sync/") for r in records)
    # verify's forward puts its tokens on the device (a host batch fed to a device model fails on any
    # accelerator) and hands back host log-probs, which it compares with vLLM's.
    assert verify_logprobs.shape == (3,) and verify_logprobs.device.type == "cpu"
    assert any(r["kind"] == "place" and r["rank"] == "0" and origin(r) == "parallel/schedules.py" for r in records)
