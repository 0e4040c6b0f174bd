"""Measurements the cost model is fitted to, and the fits.

Three kinds of samples come in while the cluster serves:

- prefills: ``(prompt tokens, cached prefix, seconds)``, reported with ``Complete(PREFILLED)``
  (the router's view of a prefill) or read from an engine's metrics (vLLM's prefill time and
  computed tokens, ``conductor.engine_load``);
- transfers: ``(bytes, seconds)``, the wait for a transfer plan the router reports with
  ``Complete(PREFILLED)``;
- decode steps: ``(requests, context tokens, seconds)``, an engine's inter-token latency.

``Calibration.model()`` is the base cost model with every part that has enough samples replaced
by its fit (``costmodel.calibrated``); refits happen every ``every`` new samples of a kind (0:
never, the base model stays). A fit that the samples do not determine keeps the previous one.
"""

from __future__ import annotations

import logging
from collections import deque

from kvstore.errors import InvalidArgument

from .costmodel import CostModel, FittedCostModel, PrefillSample, calibrated, fit_line, fit_prefill

log = logging.getLogger(__name__)

LINE_SAMPLES = 256  # transfers and decode steps kept: the recent past is what predicts


class Calibration:
    def __init__(self, base: CostModel, every: int = 0, max_samples: int = 4096) -> None:
        self.base = base
        self.every = every
        self.prefills: deque[PrefillSample] = deque(maxlen=max_samples)
        self.transfers: deque[tuple[float, float]] = deque(maxlen=LINE_SAMPLES)
        self.decodes: deque[tuple[float, float]] = deque(maxlen=LINE_SAMPLES)
        self.prefill_fit: FittedCostModel | None = None
        self.transfer_fit: tuple[float, float] | None = None
        self.decode_fit: tuple[float, float] | None = None
        self._new = {"prefill": 0, "transfer": 0, "decode": 0}

    def model(self) -> CostModel:
        return calibrated(self.base, self.prefill_fit, self.transfer_fit, self.decode_fit)

    # ---- samples: each returns True when a refit changed the model -------------------------

    def add_prefill(self, sample: PrefillSample) -> bool:
        self.prefills.append(sample)
        return self._due("prefill") and self._refit_prefill_quietly()

    def add_transfer(self, nbytes: int, seconds: float) -> bool:
        self.transfers.append((float(nbytes), seconds))
        if not self._due("transfer"):
            return False
        fit = fit_line(self.transfers)
        if fit is None:
            return False
        self.transfer_fit = fit
        log.info("transfer cost model refitted: %.3g s + %.3g s/MiB", fit[0], fit[1] * 2**20)
        return True

    def add_decode(self, tokens: int, seconds: float) -> bool:
        self.decodes.append((float(tokens), seconds))
        if not self._due("decode"):
            return False
        fit = fit_line(self.decodes)
        if fit is None:
            return False
        self.decode_fit = fit
        return True

    def refit_prefill(self, min_samples: int = 16) -> bool:
        """Fit the prefill part now; False with fewer than ``min_samples``. InvalidArgument when
        the samples do not determine it (e.g. all one size)."""
        if len(self.prefills) < min_samples:
            return False
        self.prefill_fit = fit_prefill(self.prefills, base=self.base)
        self._new["prefill"] = 0
        return True

    def _due(self, kind: str) -> bool:
        if not self.every:
            return False
        self._new[kind] += 1
        # lines have two parameters: refit sooner than the prefill's three
        every = self.every if kind == "prefill" else max(1, self.every // 4)
        if self._new[kind] < every:
            return False
        self._new[kind] = 0
        return True

    def _refit_prefill_quietly(self) -> bool:
        """Automatic refit: samples that do not determine a model yet (all one size) keep the
        current one; that is logged, not raised at the caller reporting a prefill."""
        try:
            if not self.refit_prefill(min_samples=max(self.every, 3)):
                return False
        except InvalidArgument as e:
            log.warning("prefill cost model not refitted: %s", e)
            return False
        m = self.prefill_fit
        assert m is not None
        log.info(
            "prefill cost model refitted to %d samples: quad=%.3g lin=%.3g const=%.3g",
            len(self.prefills),
            m.quad,
            m.lin,
            m.const,
        )
        return True
