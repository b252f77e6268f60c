"""Checks a real checkpoint needs, made before anything starts: ``--dry-run`` prints what :func:`check_checkpoints`
finds, and the trainer calls the same function at start-up, after the process groups and before the teacher service,
the data and the model.

- **Layout** (:func:`megatron_gkd.planning.splits.check_split`): the student's attention heads, key/value heads,
  vocabulary rows, layers and routed experts against ``parallel.*``, and a teacher that runs on the training ranks
  (``teacher.client=local``) against the same layout. Tied embeddings over several stages are stated.
- **Vocabulary**: the tokenizer's ids fit the student's table; the padding rows are stated.
- **Chat templates** (:mod:`megatron_gkd.data.templates`): a teacher whose checkpoint or tokenizer the config names
  renders sample conversations with its own template, compared with the student's. A teacher of the student's
  tokenizer whose template opens or ends the assistant's turn otherwise is refused: it would score every response in
  a turn format it does not write, and teach the student not to stop at its own end of turn. Any other difference
  (a default system prompt, another tokenizer) is a warning that shows both renderings.

A checkpoint or tokenizer that is not on this machine (a dry run planned for another) is named, not checked; at
start-up, loading it fails anyway.
"""

from __future__ import annotations

import logging
import os
import pathlib

from megatron_gkd.config.checks import teacher_configs, teacher_key
from megatron_gkd.data.templates import compare_renderings
from megatron_gkd.data.tokenization import load_tokenizer, resolve_chat_template, tokenizer_digest
from megatron_gkd.planning.model import model_shape, read_config
from megatron_gkd.planning.splits import ModelSplit, check_split
from megatron_gkd.teacher.clients import client_traits

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def check_checkpoints(config, world_size: int | None = None) -> list[str]:
    """Checks the run's checkpoints against its layout and each other (see the module docstring).

    Args:
        config: the :class:`~megatron_gkd.config.GKDConfig`.
        world_size: ranks of the run (default TP x PP), for the embedding groups of tied embeddings.

    Returns:
        What was found, a line each (the dry run prints them, the trainer logs them).

    Raises:
        ValueError: a checkpoint does not fit the layout, or a teacher's template would misalign the responses; the
            message names the key and the fix.
    """
    parallel = config.parallel
    sizes = dict(tensor_model_parallel_size=parallel.tensor_model_parallel_size,
                 pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
                 virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
                 expert_model_parallel_size=parallel.expert_model_parallel_size)
    world_size = world_size or parallel.tensor_model_parallel_size * parallel.pipeline_model_parallel_size
    lines = []
    split = _split(config.student.checkpoint, sizes, who="the student", key="student.checkpoint")
    if isinstance(split, str):
        lines.append(f"student: {split}")
    else:
        lines += [f"student {text}" if index == 0 else text for index, text in enumerate(split.describe(world_size))]
    for name, teacher in teacher_configs(config).items():
        if client_traits(teacher.client).collective:  # built on the training ranks, in their layout
            key = f"{teacher_key(config, name)}.checkpoint"
            teacher_split = _split(teacher.checkpoint, sizes, who=f"teacher {name!r}", key=key, label=key)
            lines.append(f"teacher {name!r}: {teacher_split}" if isinstance(teacher_split, str)
                         else f"teacher {name!r} {teacher_split.describe()[0]}")
    tokenizer_path = config.student.tokenizer_path
    tokenizer = _local_tokenizer(tokenizer_path)
    if tokenizer is None:
        lines.append(f"student tokenizer: not checked (no tokenizer files in {tokenizer_path})")
        return lines
    if not isinstance(split, str):
        where = "student.tokenizer" if config.student.tokenizer else "the student's tokenizer (student.checkpoint)"
        lines.append(split.vocabulary(len(tokenizer), tokenizer_key=where))
    lines += _template_lines(config, tokenizer)
    return lines


def _split(checkpoint: str | None, sizes: dict, *, who: str, key: str, label: str | None = None) -> ModelSplit | str:
    """The layout's split of the checkpoint (``key``'s), or why it was not checked; messages name the model as
    ``who (architecture, label)``."""
    if checkpoint is None:
        return "not checked (no checkpoint named)"
    try:
        hf_config = read_config(checkpoint)
    except FileNotFoundError:
        return f"not checked (no HF config at {pathlib.Path(checkpoint) / 'config.json'})"
    try:
        shape = model_shape(hf_config)
    except ValueError as error:
        raise ValueError(f"{key}={checkpoint}: {error}") from error
    return check_split(shape, **sizes, name=f"{who} ({', '.join(filter(None, (shape.architecture, label)))})",
                       key="parallel.")


def _local_tokenizer(path: str | None):
    """The HF tokenizer in directory ``path``; None when there is none on this machine."""
    if path is None or not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        return None
    return load_tokenizer(path)


def _teacher_source(teacher, key: str) -> tuple[str | None, str]:
    """Where a teacher's tokenizer (and chat template) is read (``TeacherConfig.tokenizer_source``), and its key."""
    source = teacher.tokenizer_source
    for option in ("cross_tokenizer.tokenizer", "serve.model", "checkpoint", "teacher_tokenizer"):
        section, _, field = option.rpartition(".")
        if source is not None and getattr(getattr(teacher, section) if section else teacher, field) == source:
            return source, f"{key}.{option}"
    return None, ""


def _template_of(tokenizer) -> str | None:
    try:  # a tokenizer may carry several named templates; this is the one it would use itself
        return tokenizer.get_chat_template() if tokenizer.chat_template is not None else None
    except ValueError:
        return None


def _template_lines(config, student_tokenizer) -> list[str]:
    """Each teacher's chat template against the student's (module docstring)."""
    teachers = teacher_configs(config)
    student_template = resolve_chat_template(config.data, student_tokenizer) if teachers else None
    if student_template is None:
        return ["chat template: none (prompts are raw text): teachers' templates not compared"] if teachers else []
    student_id = (len(student_tokenizer), tokenizer_digest(student_tokenizer))
    lines = []
    for name, teacher in teachers.items():
        source, source_key = _teacher_source(teacher, teacher_key(config, name))
        tokenizer = _local_tokenizer(source)
        if tokenizer is None:
            lines.append(f"chat template: teacher {name!r} not compared (no teacher tokenizer on this machine"
                         + (f" at {source_key}={source})" if source else "; the config names none)"))
            continue
        who = f"teacher {name!r} ({source_key})"
        template = _template_of(tokenizer)
        if template is None:
            logger.warning("%s has no chat template: it reads prompts in the student's chat format, which it may not "
                           "know; distil from a teacher trained on that format, or set data.chat_template=none", who)
            lines.append(f"chat template: teacher {name!r} has none (warned)")
            continue
        same = (len(tokenizer), tokenizer_digest(tokenizer)) == student_id
        try:
            difference = compare_renderings(student_tokenizer, student_template, tokenizer, template)
        except ValueError as error:  # the student's template rendered the same message in resolve_chat_template
            logger.warning("%s: %s; its template is not compared with the student's", who, error)
            lines.append(f"chat template: teacher {name!r} not compared (its template does not render; warned)")
            continue
        if not difference.any:
            lines.append(f"chat template: teacher {name!r} renders the sample conversations as the student does")
            continue
        if same and (difference.opening or difference.end):
            _refuse_misaligned(difference, who, source)
        student_text, teacher_text = difference.first_prompts()
        logger.warning("%s renders the sample conversation otherwise than the student's chat template (%s); the teacher "
                       "scores prompts in the student's format:\n  student: %r\n  teacher: %r", who,
                       "it has another tokenizer: it reads the student's prompt text" if not same else
                       "before the assistant's turn", student_text, teacher_text)
        lines.append(f"chat template: teacher {name!r} renders the sample conversations otherwise (warned)")
    return lines


def _refuse_misaligned(difference, who: str, source: str) -> None:
    student, teacher = difference.student, difference.teacher
    if difference.opening:
        what = (f"opens the assistant's turn with {teacher.opening!r} where the student's chat template opens it "
                f"with {student.opening!r}: the teacher would score every response after an opening it does not write")
    else:
        what = (f"ends the assistant's turn with {teacher.end!r} where the student's chat template ends it with "
                f"{student.end!r}: the teacher would not predict the student's end of turn, and the loss would teach "
                "the student not to stop")
    jinja = pathlib.Path(source) / "chat_template.jinja"
    fix = f"data.chat_template={jinja}" if jinja.is_file() else "data.chat_template=FILE.jinja (the teacher's template)"
    raise ValueError(f"{who} shares the student's tokenizer but {what}; set {fix} to render the prompts with the "
                     "teacher's template, or distil from a teacher whose template matches the student's")
