"""Tied embeddings over two pipeline stages train as on one stage: what ``--dry-run`` states for such a layout
(``planning.splits.ModelSplit.describe``). The last stage's output layer is its own copy of the first stage's
embedding; Megatron-Core all-reduces the two copies' gradients over the embedding group (``finalize_model_grads``,
which the step installs), so after every step both copies equal the single stage's tied table.

A SmolLM2-shaped student (9 / 3 heads, tied, 2 layers: one a stage), cross-entropy on fixed samples, two optimizer
steps at PP=1 and at PP=2."""

import pytest
import torch

from megatron_gkd.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed

NUM_STEPS = 2


def _body(checkpoint: str, layout: dict):
    from megatron.core import parallel_state as mpu

    from megatron_gkd import parallel
    from megatron_gkd.models import load_hf, unwrap
    from megatron_gkd.trainer.batch import Sample, build_microbatch, token_coefficients
    from megatron_gkd.trainer.optim import OptimizerConfig, build_lr_scheduler, build_optimizer, wrap_for_training
    from megatron_gkd.trainer.specs import LossSpec
    from megatron_gkd.trainer.step import StepRunner

    state = parallel.initialize(**layout)
    parallel.seed(0)
    config = OptimizerConfig(lr=1e-2)
    chunks = wrap_for_training(load_hf(checkpoint), config)
    optimizer = build_optimizer(config, chunks)
    runner = StepRunner(chunks, optimizer, build_lr_scheduler(config, optimizer, 10), tp_group=state.tp_group,
                        dp_group=mpu.get_data_parallel_group_gloo(), dp_size=state.data_parallel_size,
                        is_last_stage=state.is_pipeline_last_stage)
    generator = torch.Generator().manual_seed(0)
    samples = [Sample(tokens=torch.randint(3, 250, (length,), generator=generator), prompt_len=3, group=i,
                      prompt_index=i) for i, length in enumerate((9, 7, 12, 5))]
    coefficients = token_coefficients(samples, total_tokens=sum(s.response_len for s in samples), num_groups=4)
    # One shape for every micro-batch of the step, as the trainer pads them (pipeline schedules send fixed shapes).
    microbatches = [build_microbatch(samples[i:i + 2], coefficients[i:i + 2], labels=True, shape=(2, 12)) for i in (0, 2)]
    losses = [runner.train_step(LossSpec(kind="cross_entropy"), microbatches)[0] for _ in range(NUM_STEPS)]
    model = unwrap(chunks[0])
    tables = {}
    if model.pre_process:
        tables["embedding"] = model.embedding.word_embeddings.weight.detach().clone()
    if model.post_process:
        tables["output"] = model.shared_embedding_or_output_weight().detach().clone()
    parallel.destroy()
    return state.pp_rank, losses[-1], tables


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from megatron_gkd.testing.hf_models import SMOLLM2_LIKE, make_tiny_checkpoint

    return make_tiny_checkpoint("LlamaForCausalLM", tmp_path_factory.mktemp("tied"), **SMOLLM2_LIKE)


def test_both_copies_of_a_tied_table_train_as_the_one_table_of_a_single_stage(checkpoint):
    [(_, loss, single)] = run_distributed(_body, 1, args=(checkpoint, {}))
    reference = single["embedding"]
    assert single["output"].data_ptr() == reference.data_ptr() or torch.equal(single["output"], reference)
    results = sorted(run_distributed(_body, 2, args=(checkpoint, dict(pipeline_model_parallel_size=2))),
                     key=lambda result: result[0])
    (_, _, first), (_, last_loss, last) = results
    assert last_loss["loss"] == pytest.approx(loss["loss"], rel=1e-5)
    assert set(first) == {"embedding"} and set(last) == {"output"}  # the table on each stage, as stated
    torch.testing.assert_close(first["embedding"], reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(last["output"], reference, rtol=1e-5, atol=1e-6)
