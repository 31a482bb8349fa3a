"""A step's batch, reduced to what its time depends on, and the model interface."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class StepShape:
    """One engine step's work.

    prefill_tokens: prompt tokens computed in the step (all chunks);
    prefill_attention: query-key pairs those tokens attend to, causal:
        sum over chunks of n * (prefix + (n + 1) / 2) for a chunk of n tokens
        after `prefix` cached ones;
    decode_seqs: sequences decoding one token;
    decode_context: keys those decodes attend to, summed over sequences.
    """
    prefill_tokens: int = 0
    prefill_attention: float = 0.0
    decode_seqs: int = 0
    decode_context: int = 0

    @classmethod
    def build(cls, chunks: list[tuple[int, int]] = (), decode_contexts: list[int] = ()) -> "StepShape":
        """From prefill chunks as (prefix, tokens) and each decode's context length."""
        return cls(prefill_tokens=sum(n for _, n in chunks),
                   prefill_attention=sum(chunk_attention(p, n) for p, n in chunks),
                   decode_seqs=len(decode_contexts), decode_context=sum(decode_contexts))

    @property
    def is_empty(self) -> bool:
        return self.prefill_tokens == 0 and self.decode_seqs == 0

    def features(self) -> list[float]:
        """[1, prefill tokens, prefill attention, decode seqs, decode context]: the
        linear model's regressors."""
        return [1.0, float(self.prefill_tokens), float(self.prefill_attention), float(self.decode_seqs),
                float(self.decode_context)]


def chunk_attention(prefix: int, tokens: int) -> float:
    """Query-key pairs of a causal chunk of `tokens` after `prefix` cached tokens."""
    return tokens * (prefix + (tokens + 1) / 2)


class StepTimeModel(Protocol):
    def step_time(self, shape: StepShape) -> float:
        """Seconds one engine step of this shape takes on one replica."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-able description `load_step_model` reads back."""


def load_step_model(source: str | Path | dict) -> StepTimeModel:
    """A model from a profile file written by `pdserve profile` (or its dict)."""
    from cluster.perf_model.linear_model import LinearStepModel
    from cluster.perf_model.roofline import RooflineStepModel
    where = "the profile" if isinstance(source, dict) else f"profile {source}"
    try:
        data = source if isinstance(source, dict) else json.loads(Path(source).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where} is not a JSON object (`pdserve profile` writes one)")
    kind = data.get("kind")
    if kind not in ("linear", "roofline"):
        raise ValueError(f"unknown step model kind {kind!r} in {where}; expected 'linear' or 'roofline'")
    try:
        model = (LinearStepModel if kind == "linear" else RooflineStepModel).from_json(data)
    except (KeyError, TypeError, AttributeError) as exc:   # a field missing or of the wrong shape
        raise ValueError(f"{where} is malformed for a {kind} model ({type(exc).__name__}: {exc}); "
                         "write it again with `pdserve profile`") from None
    tp = (getattr(model, "meta", None) or {}).get("tp")
    if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
        raise ValueError(f"{where}: meta.tp must be an integer >= 1 (the TP degree it was measured at), "
                         f"got {tp!r}; write it again with `pdserve profile`")
    return model


def profile_tp(model: StepTimeModel) -> int | None:
    """The tensor-parallel degree a step model was profiled (or roofline-priced) at;
    None where it does not say."""
    cost = getattr(model, "cost", None)       # a roofline model carries its TP in its cost
    tp = cost.tp if cost is not None else (getattr(model, "meta", None) or {}).get("tp")
    return None if tp is None else int(tp)


def profile_tp_problem(model: StepTimeModel, pool_tps: dict[str, int]) -> str | None:
    """Why `model` cannot price pools at these TP degrees (role -> TP): it was
    measured at another; None where it fits or does not say."""
    tp = profile_tp(model)
    other = [f"{role} (TP {degree})" for role, degree in pool_tps.items() if tp is not None and degree != tp]
    if not other:
        return None
    return (f"the profile was measured at TP {tp}, and the deployment's pools {', '.join(other)} run at "
            "another degree: profile at theirs (pdserve profile --tp N)")


MODEL_SHAPE_FIELDS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "vocab_size")


def model_shape(model_config) -> dict[str, int]:
    """What a profile records of the model it measured (an engine ModelConfig's sizes)."""
    return {name: int(getattr(model_config, name)) for name in MODEL_SHAPE_FIELDS}


def profile_model_problem(model: StepTimeModel, model_config) -> str | None:
    """Why `model`'s step times are not those of `model_config`'s model (measured or
    priced for another one), or None; a profile that does not say which model it
    measured (written before profiles recorded it) passes."""
    cost = getattr(model, "cost", None)      # a roofline model: priced from its model's sizes
    if cost is not None:
        recorded = {"num_layers": cost.num_layers, "hidden_size": cost.hidden_size}
    else:
        recorded = (getattr(model, "meta", None) or {}).get("model_shape") or {}
    wanted = model_shape(model_config)
    differ = [f"{name} {recorded[name]} (this model: {wanted[name]})" for name in MODEL_SHAPE_FIELDS
              if name in recorded and recorded[name] != wanted[name]]
    if not differ:
        return None
    return (f"the profile's step times are another model's: {', '.join(differ)}; profile this one "
            "(pdserve profile --model ...)")
