"""The teacher: what trainer and service say (``protocol/``), the service (``service/``: proxy + workers), what it
scores with (``backends/``), the trainer's side (``clients/``), the teacher cache (``cache/``) and the ``teacher``
section (``config.py``).

Trainer-side use::

    from megatron_gkd.teacher import ScoreBatch, SequenceRequest, build_client
    client = build_client("zmq", address="tcp://127.0.0.1:5555")
    client.align_vocab(student_tokenizer, student_vocab_size)
    future = client.score_async(ScoreBatch(sequences=[...], top_k=64))
    outputs = future.result()          # list[TeacherOutput], validated, or an exception
    samples = client.generate(GenerateBatch(prompts=[...], num_samples=4, max_tokens=64, stop_ids=(eos,)))

Server side: ``launch/teacher_server.py`` (see docs/teacher_protocol.md).
"""

from megatron_gkd.teacher.clients import RetryPolicy, TeacherClient, build_client, client_names
from megatron_gkd.teacher.protocol.types import (
    ErrorCode,
    GenerateBatch,
    GeneratedSample,
    ScoreBatch,
    SequenceRequest,
    TeacherError,
    TeacherOutput,
    TeacherOutputError,
)

__all__ = [
    "ErrorCode", "GenerateBatch", "GeneratedSample", "RetryPolicy", "ScoreBatch", "SequenceRequest", "TeacherClient",
    "TeacherError", "TeacherOutput", "TeacherOutputError", "build_client", "client_names",
]
