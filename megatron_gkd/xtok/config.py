"""How a user asks for cross-tokenizer distillation, and the start-up check that refuses it unasked.

A teacher whose tokenizer differs from the student's was always refused ("a divergence over mismatched ids is
meaningless"). It still is, unless the run names a method; the refusal now says which key enables it:

    teacher:
      cross_tokenizer:
        method: projected        # null (default): same tokenizer required | projected (X-Token P-KL) | hybrid (H-KL)
        tokenizer: null          # the teacher's tokenizer directory; null: teacher.serve.model, teacher.checkpoint or
                                 # teacher.teacher_tokenizer
        prompt: template         # template: a conversation through the teacher's own chat template | text: the
                                 # student's prompt as text, special tokens kept (megatron_gkd.teacher.clients.cross_prompt)
        inside_groups: chain     # chain: the student tokens of a group the teacher writes as fewer tokens are compared
                                 # through the chain rule (megatron_gkd.teacher.clients.cross_request) | skip: only group heads
        boundary: teacher        # teacher: group heads compared at the teacher's token boundaries through W | text: every
                                 # position read at the text level (chain rule at heads too, boundary-corrected)
        hidden_support: topk     # teacher.signal=hidden: topk (its exact top-k through W) | full (its whole vocabulary)
        projection_map: null     # a map saved by ProjectionMap.save; null: built from the two tokenizers at start-up
        max_pieces: 4            # the map's rule (megatron_gkd.xtok.projection)
        decay: 0.5

The method names are the loss's (``megatron_gkd.losses`` ``PROJECTION_METHODS``). ``TeacherConfig.cross_tokenizer``
holds it; :func:`check_tokenizers` runs where the client checks the vocabularies (``check_vocab``), and
:mod:`.request` is what the trainer does with such a teacher.
"""

from __future__ import annotations

import dataclasses
import logging

from megatron_gkd.registry import Choice, closest
from megatron_gkd.xtok.projection import ProjectionMap

logger = logging.getLogger(__name__)

ENABLE_KEY = "teacher.cross_tokenizer.method"
METHODS = ("projected", "hybrid")
INSIDE_GROUPS = ("chain", "skip")
BOUNDARIES = ("teacher", "text")
PROMPTS = ("template", "text")


class HiddenSupport(Choice):
    """``teacher.cross_tokenizer.hidden_support``: what a cross-tokenizer hidden signal is compared over."""

    TOPK = "topk"
    FULL = "full"

    @property
    def whole_vocabulary(self) -> bool:
        """The teacher's exact distribution over its whole vocabulary, not its top-k made in the step."""
        return self is HiddenSupport.FULL


HIDDEN_SUPPORTS = HiddenSupport.values()


@dataclasses.dataclass(kw_only=True, slots=True)
class CrossTokenizerConfig:
    """Cross-tokenizer distillation (a teacher of another tokenizer).

    Attributes:
        method: ``None`` (the teacher must share the student's tokenizer), ``projected`` (X-Token's P-KL: the
            student's distribution projected into the teacher's vocabulary through ``W``) or ``hybrid`` (H-KL:
            exact string matches compared directly, the projection elsewhere).
        tokenizer: the teacher's tokenizer (an HF directory); ``None``: the teacher's own checkpoint directory
            (``teacher.serve.model`` or ``teacher.checkpoint``) or ``teacher.teacher_tokenizer``.
        prompt: what the teacher reads before the response (:mod:`megatron_gkd.teacher.clients.cross_prompt`). ``template``
            (default): a prompt rendered from a conversation (the student's chat template was used) is that
            conversation through the teacher's OWN chat template, as the teacher would read it if it served the
            conversation itself; raw text stays raw text. ``text``: the student's rendered prompt as text with its
            special tokens kept, encoded by the teacher (a special token's string that the teacher knows becomes its
            id): for a teacher trained on the student's template, or none of its own.
        inside_groups: ``chain`` (default): in a group where the teacher's token is longer than the student's (n:1,
            n:m; the numeral case), every student position is compared with the teacher's distribution over the
            student token its tokens continue with (the chain rule over the teacher's top-k,
            :mod:`megatron_gkd.teacher.clients.cross_request`); ``skip``: only the group's head is compared, through ``W``.
        boundary: ``teacher`` (default): a group's head is compared with the teacher's row at its first token, through
            ``W``. ``text``: every position but a 1:n head (the student's token longer) is compared in the student's
            vocabulary with the teacher's distribution read at the text level: the chain rule at heads too, and at a
            head that follows a teacher token other teacher tokens extend (``"1"`` of ``"1 6 3 8"``), the teacher's
            row there (conditioned on its token having ended) mixed with the previous row's tokens that go on past
            the boundary, by their probabilities (:mod:`megatron_gkd.teacher.clients.cross_request`). Needs ``inside_groups=chain``.
        hidden_support: with ``teacher.signal=hidden``, what the projected student is compared with. ``topk``
            (default): the teacher's exact top-``teacher.top_k`` made in the step from its hidden states
            (:func:`~megatron_gkd.losses.hidden_topk`), through the log-space top-k loss
            (:func:`~megatron_gkd.losses.cross_vocab_distill_loss`). ``full``: its exact distribution over its whole
            vocabulary (:func:`~megatron_gkd.losses.hidden_cross_vocab_distill_loss`): no truncation, at 3-6x the
            same-tokenizer hidden loss's time and with fp32 limits (docs/running.md "A teacher of another tokenizer").
        projection_map: path of a map saved by :meth:`ProjectionMap.save`; it must have been built for this pair
            of tokenizers. ``None``: built from the two tokenizers at start-up (seconds; see docs/performance.md).
        max_pieces, decay: the map's re-tokenisation rule (:func:`megatron_gkd.xtok.build_projection`).
    """

    method: str | None = None
    tokenizer: str | None = None
    prompt: str = "template"
    inside_groups: str = "chain"
    boundary: str = "teacher"
    hidden_support: str = "topk"
    projection_map: str | None = None
    max_pieces: int = 4
    decay: float = 0.5

    def __post_init__(self):
        if self.method is not None and self.method not in METHODS:
            raise ValueError(f"{ENABLE_KEY}={self.method!r} is not one of null, {', '.join(METHODS)}"
                             f"{closest(self.method, list(METHODS))}")
        if self.prompt not in PROMPTS:
            raise ValueError(f"teacher.cross_tokenizer.prompt={self.prompt!r} is not one of {', '.join(PROMPTS)}"
                             f"{closest(self.prompt, list(PROMPTS))}")
        if self.inside_groups not in INSIDE_GROUPS:
            raise ValueError(f"teacher.cross_tokenizer.inside_groups={self.inside_groups!r} is not one of "
                             f"{', '.join(INSIDE_GROUPS)}{closest(self.inside_groups, list(INSIDE_GROUPS))}")
        if self.boundary not in BOUNDARIES:
            raise ValueError(f"teacher.cross_tokenizer.boundary={self.boundary!r} is not one of {', '.join(BOUNDARIES)}"
                             f"{closest(self.boundary, list(BOUNDARIES))}")
        if self.hidden_support not in HIDDEN_SUPPORTS:
            raise ValueError(f"teacher.cross_tokenizer.hidden_support={self.hidden_support!r} is not one of "
                             f"{', '.join(HIDDEN_SUPPORTS)}{closest(self.hidden_support, list(HIDDEN_SUPPORTS))}")
        self.hidden_support = HiddenSupport(self.hidden_support)  # a str field for OmegaConf, converted once
        if self.boundary == "text" and self.inside_groups != "chain":
            raise ValueError("teacher.cross_tokenizer.boundary=text reads every position through the chain rule: set "
                             "teacher.cross_tokenizer.inside_groups=chain")
        if self.max_pieces < 1 or not 0.0 <= self.decay <= 1.0:
            raise ValueError(f"teacher.cross_tokenizer.max_pieces must be >= 1 and decay in [0, 1], got "
                             f"{self.max_pieces}, {self.decay}")

    @property
    def enabled(self) -> bool:
        return self.method is not None


def check_tokenizers(config: CrossTokenizerConfig, *, student_digest: str, teacher_digest: str,
                     projection: ProjectionMap | None = None) -> bool:
    """The start-up decision: True when the run distils across tokenizers, False when both sides share one.

    Raises:
        ValueError: the tokenizers differ and no method was asked for (the message names :data:`ENABLE_KEY`), or
            ``projection`` was built for another pair of tokenizers.
    """
    if student_digest == teacher_digest:
        if config.enabled:
            logger.warning("%s=%s has no effect: the teacher and the student share one tokenizer (digest %s), so "
                           "the same-tokenizer loss is used", ENABLE_KEY, config.method, student_digest[:12])
        return False
    if not config.enabled:
        raise ValueError(f"tokenizer mismatch: the teacher's tokenizer (digest {teacher_digest[:12]}) differs from the "
                         f"student's ({student_digest[:12]}), and a divergence over mismatched ids is meaningless. To "
                         f"distil across tokenizers set {ENABLE_KEY}=projected (X-Token's P-KL) or hybrid (H-KL); "
                         "otherwise use a teacher with the student's tokenizer")
    if projection is not None:
        projection.check_pair(student_digest=student_digest, teacher_digest=teacher_digest)
    return True
