"""Cost models: how long prefill, KV transfer and a decode step take.

The scheduler asks a ``CostModel`` four questions (all in seconds or bytes, all O(1)):

- ``prefill_seconds(tokens, prefix_tokens)``: compute the prompt's uncached suffix when the first
  ``prefix_tokens`` already have KV cache.
- ``kv_bytes(tokens)``: KV cache size of ``tokens`` tokens of the modelled model.
- ``transfer_seconds(nbytes)``: move ``nbytes`` of KV cache between two nodes.
- ``decode_step_seconds(requests, tokens)``: one decode step (time between tokens) of a batch of
  ``requests`` holding ``tokens`` tokens of context in total.

``FlopsCostModel`` is Mooncake's analytic model (FAST'25, Table 1 / §5): prefill of ``n`` tokens
costs ``flops(n) = l * (a * n^2 * d + b * n * d^2)``; with a cached prefix of ``p`` tokens the
suffix costs ``flops(n) - flops(p)`` (the suffix attends to the whole prompt, the linear layers
only run on the suffix). Defaults are Table 1's LLaMA3-70B on 8xA800.

``FittedCostModel`` replaces the prefill part by ``quad * (n^2 - p^2) + lin * (n - p) + const``
fitted by least squares from measured ``(n, prefix, seconds)`` samples (``fit_prefill``); the
analytic model is the special case ``const = 0``. It may also replace the transfer estimate by
``const + bytes * per_byte`` and the decode step by ``const + tokens * per_token``, each fitted
to measurements (``fit_line``: transfers the router waited for, the engines' inter-token
latencies): an analytic model of 8 A800s says nothing of a tiny model on a CPU, or of what a
messenger round trip really costs, and a transfer planned on a wrong estimate delays the request
it was meant to speed up.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

import numpy as np

from kvstore.errors import InvalidArgument


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Mooncake Table 1 notation: ``layers`` = l, ``hidden`` = d, ``a``/``b`` the attention and
    linear-layer FLOP constants, ``gqa`` the query heads per KV head, ``elem_bytes`` = s."""

    layers: int = 80
    hidden: int = 8192
    a: float = 4.0
    b: float = 22.0
    gqa: int = 8
    elem_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer: ``l * 2 * (d / gqa) * s`` (327,680 B for LLaMA3-70B)."""
        return int(self.layers * 2 * (self.hidden // self.gqa) * self.elem_bytes)

    @property
    def weight_bytes(self) -> float:
        """Weights read once per decode step: the linear layers' ``b * d^2 / 2`` params per
        layer (``b * n * d^2`` FLOPs = 2 FLOPs per weight per token)."""
        return self.layers * self.b * self.hidden**2 / 2 * self.elem_bytes


@dataclass(frozen=True, kw_only=True)
class HardwareSpec:
    """One inference instance (Table 1: 8xA800, 312 TFLOPS bf16 each, 800 Gbps of NICs)."""

    gpus: int = 8
    flops_per_gpu: float = 312e12
    mfu: float = 0.5  # achieved fraction of peak FLOPs during prefill
    hbm_bytes_per_s: float = 2.039e12  # per GPU (A800 80GB)
    mbu: float = 0.6  # achieved fraction of HBM bandwidth during decode
    nic_gbps: float = 800.0  # per instance, all NICs together
    nic_efficiency: float = 0.8  # achieved fraction of line rate for KV transfers
    transfer_latency_s: float = 1e-3  # fixed cost of starting a transfer

    @property
    def prefill_flops_per_s(self) -> float:
        return self.gpus * self.flops_per_gpu * self.mfu

    @property
    def nic_bytes_per_s(self) -> float:
        return self.nic_gbps * 1e9 / 8 * self.nic_efficiency


class CostModel(ABC):
    """What the scheduler needs to estimate TTFT and TBT. Implementations are immutable."""

    @abstractmethod
    def prefill_seconds(self, tokens: int, prefix_tokens: int = 0) -> float:
        """Time to prefill a ``tokens``-token prompt whose first ``prefix_tokens`` are cached."""

    @abstractmethod
    def kv_bytes(self, tokens: int) -> int:
        """KV cache bytes of ``tokens`` tokens."""

    @abstractmethod
    def transfer_seconds(self, nbytes: int) -> float:
        """Time to move ``nbytes`` of KV cache from one node to another (0 for 0 bytes)."""

    @abstractmethod
    def decode_step_seconds(self, requests: int, tokens: int) -> float:
        """Time per output token of a decode batch of ``requests`` with ``tokens`` context."""

    def queued_prefill_seconds(self, tokens: int) -> float:
        """Seconds of prefill work behind ``tokens`` queued prompt tokens whose split into
        requests is unknown (a node's heartbeat): the per-token part only, a lower bound."""
        return tokens * self.prefill_seconds(1) if tokens > 0 else 0.0


def _check_tokens(tokens: int, prefix_tokens: int) -> None:
    if tokens < 0 or prefix_tokens < 0:
        raise InvalidArgument(f"token counts must be >= 0, got {tokens} and {prefix_tokens}")


@dataclass(frozen=True, kw_only=True)
class FlopsCostModel(CostModel):
    """Mooncake's analytic model; every estimate derives from ``model`` and ``hardware``."""

    model: ModelSpec = ModelSpec()
    hardware: HardwareSpec = HardwareSpec()

    def __post_init__(self) -> None:
        # NOTE: the scheduler prices every node per request: precompute the constants once.
        m, hw = self.model, self.hardware
        rate = hw.prefill_flops_per_s
        object.__setattr__(self, "_quad", m.layers * m.a * m.hidden / rate)
        object.__setattr__(self, "_lin", m.layers * m.b * m.hidden**2 / rate)
        object.__setattr__(self, "_kv_token", m.kv_bytes_per_token)
        object.__setattr__(self, "_weights", m.weight_bytes)
        object.__setattr__(self, "_hbm", hw.gpus * hw.hbm_bytes_per_s * hw.mbu)
        object.__setattr__(self, "_nic", hw.nic_bytes_per_s)

    def flops(self, n: int) -> float:
        """``l * (a * n^2 * d + b * n * d^2)``: FLOPs to prefill ``n`` tokens from scratch."""
        m = self.model
        return m.layers * (m.a * n * n * m.hidden + m.b * n * m.hidden * m.hidden)

    def prefill_seconds(self, tokens: int, prefix_tokens: int = 0) -> float:
        """``(flops(n) - flops(p)) / (gpus * peak * mfu)``."""
        if tokens < 0 or prefix_tokens < 0:
            _check_tokens(tokens, prefix_tokens)
        p = prefix_tokens if prefix_tokens < tokens else tokens
        return self._quad * (tokens * tokens - p * p) + self._lin * (tokens - p)  # type: ignore

    def kv_bytes(self, tokens: int) -> int:
        return tokens * self._kv_token  # type: ignore[attr-defined,no-any-return]

    def transfer_seconds(self, nbytes: int) -> float:
        if nbytes <= 0:
            return 0.0
        return self.hardware.transfer_latency_s + nbytes / self._nic  # type: ignore

    def decode_step_seconds(self, requests: int, tokens: int) -> float:
        """Memory-bound: each step reads the weights once and every request's KV cache."""
        if requests <= 0:
            return 0.0
        return (self._weights + tokens * self._kv_token) / self._hbm  # type: ignore

    def queued_prefill_seconds(self, tokens: int) -> float:
        return self._lin * tokens if tokens > 0 else 0.0  # type: ignore[attr-defined]

    def coefficients(self) -> tuple[float, float, float]:
        """``(quad, lin, const)`` with prefill = quad*(n^2-p^2) + lin*(n-p) + const."""
        return self._quad, self._lin, 0.0  # type: ignore[attr-defined]


@dataclass(frozen=True, kw_only=True)
class FittedCostModel(CostModel):
    """Prefill time ``quad*(n^2-p^2) + lin*(n-p) + const`` (``const`` only when something is
    computed); KV size comes from ``base``, and so do transfer and decode estimates unless
    ``transfer`` (seconds per transfer, per byte) or ``decode`` (seconds per step, per context
    token) are given."""

    quad: float
    lin: float
    const: float = 0.0
    base: CostModel = FlopsCostModel()
    transfer: tuple[float, float] | None = None
    decode: tuple[float, float] | None = None

    def prefill_seconds(self, tokens: int, prefix_tokens: int = 0) -> float:
        _check_tokens(tokens, prefix_tokens)
        p = min(prefix_tokens, tokens)
        if p == tokens:
            return 0.0
        return self.quad * (tokens * tokens - p * p) + self.lin * (tokens - p) + self.const

    def kv_bytes(self, tokens: int) -> int:
        return self.base.kv_bytes(tokens)

    def transfer_seconds(self, nbytes: int) -> float:
        if self.transfer is None:
            return self.base.transfer_seconds(nbytes)
        return self.transfer[0] + nbytes * self.transfer[1] if nbytes > 0 else 0.0

    def decode_step_seconds(self, requests: int, tokens: int) -> float:
        if self.decode is None:
            return self.base.decode_step_seconds(requests, tokens)
        return self.decode[0] + tokens * self.decode[1] if requests > 0 else 0.0

    def queued_prefill_seconds(self, tokens: int) -> float:
        return self.lin * tokens if tokens > 0 else 0.0

    def coefficients(self) -> tuple[float, float, float]:
        return self.quad, self.lin, self.const


def prefill_coefficients(model: CostModel) -> tuple[float, float, float] | None:
    """``(quad, lin, const)`` of a model whose prefill has that form, else None."""
    if isinstance(model, (FlopsCostModel, FittedCostModel)):
        return model.coefficients()
    return None


def calibrated(
    base: CostModel,
    prefill: CostModel | None = None,
    transfer: tuple[float, float] | None = None,
    decode: tuple[float, float] | None = None,
) -> CostModel:
    """``base`` with the fitted parts given (a prefill fit, transfer or decode lines) in place
    of its own; ``base`` itself when none is given, or when it is a custom model whose prefill
    has no ``(quad, lin, const)`` form to carry the fits."""
    if prefill is None and transfer is None and decode is None:
        return base
    coef = prefill_coefficients(prefill if prefill is not None else base)
    if coef is None:
        return base
    return FittedCostModel(
        quad=coef[0], lin=coef[1], const=coef[2], base=base, transfer=transfer, decode=decode
    )


@dataclass(frozen=True, slots=True)
class PrefillSample:
    """One measured prefill: ``tokens`` prompt tokens, ``prefix_tokens`` of them cached."""

    tokens: int
    prefix_tokens: int
    seconds: float


def fit_prefill(
    samples: Iterable[PrefillSample | Sequence[float]], base: CostModel | None = None
) -> FittedCostModel:
    """Least-squares fit of ``quad``, ``lin``, ``const`` (each clamped to >= 0) to measured
    prefills. Needs at least three samples with distinct suffix sizes; raises InvalidArgument
    otherwise. One numpy solve: O(samples)."""
    rows = [
        (s.tokens, s.prefix_tokens, s.seconds)
        if isinstance(s, PrefillSample)
        else (s[0], s[1], s[2])
        for s in samples
    ]
    if len(rows) < 3:
        raise InvalidArgument(f"fitting a cost model needs >= 3 samples, got {len(rows)}")
    arr = np.asarray(rows, dtype=np.float64)
    n, p, t = arr[:, 0], np.minimum(arr[:, 1], arr[:, 0]), arr[:, 2]
    if (n < 0).any() or (p < 0).any() or (t < 0).any() or not np.isfinite(arr).all():
        raise InvalidArgument("samples must be finite, non-negative (tokens, prefix, seconds)")
    x = np.stack([n * n - p * p, n - p, np.ones_like(n)], axis=1)
    if np.linalg.matrix_rank(x) < 3:
        raise InvalidArgument("samples do not determine the model: vary the suffix length")
    # NOTE: scale columns so the solve is well conditioned (n^2 ~ 1e8 next to 1).
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    coef, *_ = np.linalg.lstsq(x / scale, t, rcond=None)
    coef = coef / scale
    if (coef < 0).any():
        # Refit with the negative terms dropped: a negative FLOP term is noise, not physics.
        keep = coef >= 0
        sub, *_ = np.linalg.lstsq(x[:, keep] / scale[keep], t, rcond=None)
        coef = np.zeros(3)
        coef[keep] = np.maximum(sub / scale[keep], 0.0)
    quad, lin, const = (float(c) for c in coef)
    return FittedCostModel(quad=quad, lin=lin, const=const, base=base or FlopsCostModel())


def fit_line(points: Iterable[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares ``y = a + b * x`` with ``a, b >= 0`` (a negative term is noise), or None
    without at least three finite points. All ``x`` equal: ``b = 0``, ``a`` their mean."""
    arr = np.asarray([p for p in points if math.isfinite(p[0]) and math.isfinite(p[1])])
    if arr.shape[0] < 3:
        return None
    x, y = arr[:, 0], np.maximum(arr[:, 1], 0.0)
    if np.ptp(x) == 0:
        return float(y.mean()), 0.0
    b, a = np.polyfit(x, y, 1)
    if b < 0:
        return float(y.mean()), 0.0
    if a < 0:
        return 0.0, float(max((x * y).sum() / (x * x).sum(), 0.0))  # through the origin
    return float(a), float(b)


def with_mfu(model: FlopsCostModel, mfu: float) -> FlopsCostModel:
    """The same model at another MFU (0 < mfu <= 1)."""
    if not 0 < mfu <= 1 or math.isnan(mfu):
        raise InvalidArgument(f"mfu must be in (0, 1], got {mfu}")
    return replace(model, hardware=replace(model.hardware, mfu=mfu))


DEFAULT_COST_MODEL = FlopsCostModel()
