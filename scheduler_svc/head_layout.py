"""The LM head's weight in whichever memory layout multiplies faster here.

Every step multiplies its rows' last hidden states (1 to a few dozen rows)
by the LM head's weight, ``[vocab, hidden]``, stored row after row as the
checkpoint has it. On a CPU the same values stored column after column (the
transpose made contiguous, then viewed back) can multiply much faster: on
this project's 2-core host, for the 8-layer 512-wide model's 32,001 x 512
float32 head, one row 6.2 -> 2.6 ms and 32 rows 15.8 -> 13.1 ms (MKL's
kernel for the other layout), while the layers' own weights, 512 to 2,048
wide, show no difference either way; the head is the one weight that
matters, as it is a third of such a model's 32-row decode step. Which layout
wins depends on the CPU, the BLAS, the dtype and the shape, so
`lay_out` measures both on a slice of the weight and keeps the winner
(`--lm-head-layout auto`, the default); `stored` and `columns` skip the
measurement and take one.

The values are the same; only the order of a dot product's sums may change
(the last bits of a logit). On CUDA the weight stays as it is.
"""

from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger(__name__)

# Rows a step multiplies: one stream decoding, and a full batch.
ROWS = (1, 32)
# Bytes of the weight the measurement multiplies: more than a CPU's last-level
# cache, so that it sees the memory traffic a step does (a slice that fits in
# the cache hides the difference: 8,192 rows of the 8x512 head measured 2.7
# against 3.0 ms, the whole head 2.6 against 6.2 for one row), and a bound
# on its time whatever the vocabulary.
PROBE_BYTES = 64 * 1024 * 1024
REPEATS = 7
# The other layout must be this much faster to be taken (noise is ~2 %).
MARGIN = 0.05


def column_major(weight: torch.Tensor) -> torch.Tensor:
    """`weight`'s values, stored column after column, with its shape."""
    return weight.t().contiguous().t()


LAYOUTS = ("auto", "stored", "columns")


def lay_out(weight: torch.Tensor, layout: str = "auto") -> torch.Tensor:
    """`weight` itself (`stored`), or its values stored column after column
    (`columns`), or (`auto`) the latter when it multiplied hidden states
    faster by `MARGIN` on this host just now: only a 2-D contiguous CPU
    weight is measured, any other stays as it is."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown LM head layout {layout!r}; one of {', '.join(LAYOUTS)}")
    if layout == "stored" or weight.dim() != 2:
        return weight
    if layout == "columns":
        log.info("the LM head is stored column after column (--lm-head-layout columns)")
        return column_major(weight)
    if weight.device.type != "cpu" or not weight.is_contiguous():
        return weight
    probe = weight[: max(1, PROBE_BYTES // (weight.shape[1] * weight.element_size()))]
    laid = column_major(probe)
    stored, other = _seconds(probe, laid)
    if other >= stored * (1 - MARGIN):
        log.info("the LM head stays as stored (%.2f ms a multiplication against %.2f)", stored * 1e3, other * 1e3)
        return weight
    log.info(
        "the LM head is stored column after column: %.2f ms a multiplication against %.2f as the checkpoint has it",
        other * 1e3,
        stored * 1e3,
    )
    return laid if probe.shape[0] == weight.shape[0] else column_major(weight)


def _seconds(stored: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    """The best time of `REPEATS` multiplications by each weight, summed over
    `ROWS`; the two taken in turn, so that both see the same load."""
    best = [0.0, 0.0]
    with torch.inference_mode():
        for rows in ROWS:
            hidden = torch.randn(rows, stored.shape[1], dtype=stored.dtype)
            times: list[list[float]] = [[], []]
            for _ in range(REPEATS + 1):  # the first of each touches the memory: not counted
                for i, weight in enumerate((stored, other)):
                    start = time.perf_counter()
                    torch.nn.functional.linear(hidden, weight)
                    times[i].append(time.perf_counter() - start)
            best = [total + min(seen[1:]) for total, seen in zip(best, times, strict=True)]
    return best[0], best[1]
