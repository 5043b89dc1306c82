"""Each optimizer rule's hyperparameters, by the rule's own names (torchtitan's
`optimizer_factory_kwargs_by_name`; STYLE.md 29): Adam's are `betas` and `eps`, Lion's `beta1`
and `beta2` as its paper names them, and no key means one thing for one rule and another for the next.

A rule (session/optimizers.py) declares here, with `@declare`, a frozen model of what it takes
beside the learning rate and the weight decay, which every rule takes: each field's name, type,
default, limits and description. The rule receives them as keyword arguments by those names,
checked against the declaration, and records them in its parameter group (so checkpoints hold
them by the same names). The config's optimizer section (bert/config/sections.py) is made from
the declarations, one section per rule tagged by `optimizer.name`, and docs/config.md from their
descriptions. They live apart from the rules so that a config is checked before torch is
imported (a rule is a torch optimizer).

A new rule is its declaration here and its class in session/optimizers.py: nothing else.
"""
from __future__ import annotations

from typing import Annotated, ClassVar, Optional

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["HYPERPARAMETERS", "RESERVED", "AdamWHyperparameters", "Decay", "Hyperparameters", "LambHyperparameters",
           "LionHyperparameters", "SGDHyperparameters", "declare"]

# What every rule takes besides its own (session.flat.FlatOptimizer's arguments, the config's
# common keys): no declaration may use these names.
RESERVED = frozenset({"name", "learning_rate", "lr", "weight_decay", "max_grad_norm", "param_dtype", "fused", "seed",
                      "bucket_numel", "stage_group", "no_decay", "holding"})

# A moving average's decay: 0 keeps nothing of the past, 1 would never move.
Decay = Annotated[float, Field(ge=0, lt=1)]
# Adam's ε may be 0 where a comparison needs it (bench/_lamb.py), never in training: a tensor
# whose gradient is all zero (the attention's key bias) would step by 0/0.
_EPS = "added to the second moment's root (ε); 0 makes a tensor whose gradient is all zero NaN"


class Hyperparameters(BaseModel):
    """A rule's own hyperparameters (this base declares none). `rule` is the name configs and
    checkpoints give the rule; the class docstring describes the rule (docs/config.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
    rule: ClassVar[str] = ""


# The declarations by rule name, in the order they were declared.
HYPERPARAMETERS: dict[str, type[Hyperparameters]] = {}


def declare(declaration: type[Hyperparameters]) -> type[Hyperparameters]:
    """Register a rule's declaration under its `rule` name (a class decorator)."""
    clash = sorted(RESERVED & set(declaration.model_fields))
    if not declaration.rule or declaration.rule in HYPERPARAMETERS or clash:
        raise ValueError(f"{declaration.__name__}: a declaration needs a rule name of its own (got "
                         f"{declaration.rule!r}; declared: {sorted(HYPERPARAMETERS)}) and fields named apart from "
                         f"those every rule takes {sorted(RESERVED)}" + (f" (clash: {clash})" if clash else ""))
    HYPERPARAMETERS[declaration.rule] = declaration
    return declaration


@declare
class LambHyperparameters(Hyperparameters):
    """LAMB (You et al. 2020, Algorithm 2) as PopART's LambNoBias runs it: Adam's moments with
    bias correction, decoupled weight decay and a per-tensor trust ratio ‖p‖/‖u‖; biases and
    layer-norm weights take neither weight decay nor the trust ratio. The fused op when it is built."""

    rule: ClassVar[str] = "lamb"
    betas: tuple[Decay, Decay] = Field((0.9, 0.999), description="the decays of the first and second moments "
                                       "(β₁, β₂)")
    eps: float = Field(1e-6, ge=0, description=_EPS)
    max_trust_ratio: Optional[float] = Field(None, gt=0, description="clamp each tensor's trust ratio to this; none: "
                                             "unbounded")


@declare
class AdamWHyperparameters(Hyperparameters):
    """AdamW (Loshchilov & Hutter 2019): LAMB's step with the trust ratio off on every tensor,
    on the same fused kernel; biases and layer-norm weights take no weight decay."""

    rule: ClassVar[str] = "adamw"
    betas: tuple[Decay, Decay] = Field((0.9, 0.999), description="the decays of the first and second moments "
                                       "(β₁, β₂)")
    eps: float = Field(1e-6, ge=0, description=_EPS)


@declare
class LionHyperparameters(Hyperparameters):
    """Lion (Chen et al. 2023, Algorithm 2): each step is the sign of an interpolation of the
    momentum and the gradient, so every element moves by the learning rate; the paper advises a
    learning rate 3-10× smaller than AdamW's and a weight decay as much larger. Biases and
    layer-norm weights take no weight decay."""

    rule: ClassVar[str] = "lion"
    beta1: Decay = Field(0.9, description="β₁: the step is sign(β₁·m + (1 − β₁)·g)")
    beta2: Decay = Field(0.99, description="β₂: the momentum's decay, m ← β₂·m + (1 − β₂)·g")


@declare
class SGDHyperparameters(Hyperparameters):
    """SGD with momentum (Polyak 1964; Nesterov's look-ahead as Sutskever et al. 2013 write it,
    and as torch.optim.SGD steps with dampening 0) and decoupled weight decay (SGDW, Loshchilov &
    Hutter 2019, Algorithm 1); biases and layer-norm weights take no weight decay."""

    rule: ClassVar[str] = "sgd"
    momentum: Decay = Field(0.9, description="μ: the velocity's decay, v ← μ·v + g; 0: plain SGD")
    nesterov: bool = Field(False, description="step by g + μ·v (Nesterov's momentum) instead of v")
