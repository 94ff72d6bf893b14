"""The token-level KL term's config: which estimator, k, tail, clip (the KL registry decides
everything else about a loss type)."""

from __future__ import annotations

from dataclasses import dataclass

from emapg_megatron.configurable import ANY_NUMBER, at_least, check_fields, option
from emapg_megatron.errors import ConfigError
from emapg_megatron.kl.catalog import TOPK_TAILS

TOPK_SOURCES = ("auto", "policy", "anchor")
from emapg_megatron.kl.registry import LOSS_TYPE_NAMES, SAMPLED, loss_type, uses_topk


@dataclass
class KLConfig:
    """The token-level KL estimator against the anchor."""

    loss_type: str = option("topk-reverse", flag="--kl-loss-type", choices=LOSS_TYPE_NAMES)
    """Token-level KL estimator against the anchor: sampled k1..k5/k3++, Top-k KL, or a Top-k
    f-divergence."""
    k: int = option(32, flag="--kl-topk-tokens", range=at_least(0))
    """k of the Top-k estimators (>= 1 for topk-*)."""
    alpha: float | None = option(None, flag="--kl-alpha", range=ANY_NUMBER)
    """alpha of the alpha-divergence (--kl-loss-type topk-alpha only): any finite value but 0 and
    1, which are the two KL limits."""
    tail: str = option("unbiased", flag="--kl-tail", choices=TOPK_TAILS)
    """Top-k tail: unbiased (default: exact KL in expectation, value and gradient), paper
    (Algorithms 1/2 as printed: biased gradient), and the peers' biased, deterministic ones for
    comparison: none = truncate (the exact terms on q only, as verl's top-k distillation), renorm
    (KL of student and anchor both renormalised over q, as NeMo-RL's). See docs/kl_estimators.md."""
    iw_clip: tuple[float, float] | None = option(None, flag="--kl-iw-clip", metavar=("MIN", "MAX"),
                                                 range=at_least(0))
    """Clip the importance weight pi/pi_sampling of the sampled KL terms: the Top-k estimators'
    tail (no effect with --kl-tail none, truncate or renorm) and the sampled k1..k5 estimators."""
    topk_source: str = option("auto", flag="--kl-topk-source", choices=TOPK_SOURCES)
    """Whose top-k ids form the Top-k estimators' set q: auto follows the loss type (reverse-type:
    the policy's, i.e. pi_old, the student's with a teacher; forward-type: the anchor's, the EMA's or
    the teacher's; Algorithms 1 and 2); policy or anchor forces one (NeMo-RL's distillation takes the
    teacher's top-k for every KL direction: anchor). Any q fixed before the update keeps the
    unbiased tail unbiased; the choice moves variance (docs/kl_estimators.md)."""
    reference_clamps: bool = option(False, flag="--kl-reference-clamps")
    """Apply the paper's reference code's numerical clamps (biased where they bind; off: the exact
    formulas): log(pi/pi_sampling) to [-20, 20] before the importance weight's exp, log w to
    [-20, 20] in K3, K3++ and K5 (sampled k5 and the topk-forward tail), the K3 / K3++ value to
    [-10, 10]. See docs/kl_estimators.md."""

    def __post_init__(self):
        if self.iw_clip is not None:
            self.iw_clip = tuple(self.iw_clip)  # a YAML or argparse list

    def validate(self) -> None:
        """The flags of the KL term, checked once (raises ConfigError with one line)."""
        check_fields(self)
        kind = loss_type(self.loss_type)
        if kind.family != SAMPLED and self.k < 1:
            raise ConfigError(f"--kl-loss-type {self.loss_type} needs --kl-topk-tokens >= 1 (got {self.k})")
        if not kind.needs_alpha and self.alpha is not None:
            raise ConfigError(f"--kl-alpha is only for --kl-loss-type topk-alpha (got {self.loss_type})")
        if kind.needs_alpha:
            if self.alpha is None:
                raise ConfigError("--kl-loss-type topk-alpha needs --kl-alpha")
            try:
                kind.check_alpha(self.alpha)
            except ValueError as e:
                raise ConfigError(f"--kl-alpha: {e}") from None
        if self.iw_clip is not None and not 0 <= self.iw_clip[0] <= self.iw_clip[1]:
            raise ConfigError(f"--kl-iw-clip needs 0 <= MIN <= MAX (got {self.iw_clip[0]} {self.iw_clip[1]})")

    @property
    def q_source(self) -> str | None:
        """Which pass takes the top-k ids: "old" (pi_old), "anchor" (pi_ema or the teacher), or None."""
        if not uses_topk(self.loss_type, self.k):
            return None
        if self.topk_source != "auto":
            return {"policy": "old", "anchor": "anchor"}[self.topk_source]
        return loss_type(self.loss_type).q_source(self.alpha)

    @property
    def uses_topk(self) -> bool:
        return self.q_source is not None

    @property
    def topk_tokens(self) -> int:
        """k actually used: 0 for the sampled estimators (which need no top-k ids)."""
        return self.k if uses_topk(self.loss_type, self.k) else 0
