"""One step on one rank (DESIGN.md §6).

    apply drops and feeds → read new requests' tensors → ONE agreement
    all_gather → release the step's segments (rank 0) → forward every running
    request → sample (rank 0)

The engine keeps each request's KV cache. It holds no policy: which requests
join, leave or stop is decided by rank 0's loop and arrives in the plan.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from mmsplit.errors import E, MmsplitError
from scheduler_svc.agreement import agree_on_failures
from scheduler_svc.collective import Collective
from scheduler_svc.plan import NewRequest, Plan, StepOutcome
from scheduler_svc.reader import TensorReader

log = logging.getLogger(__name__)


@dataclass
class Running:
    request: NewRequest
    # Pixel tensors until the prefill consumed them.
    pixels: list[torch.Tensor] | None
    cache: DynamicCache | None = None
    # The next input token; None before the prefill.
    feed: int | None = None
    generator: torch.Generator | None = field(default=None, repr=False)


class Engine:
    def __init__(self, model: torch.nn.Module, coll: Collective, reader: TensorReader, device: torch.device) -> None:
        self.model = model
        self.coll = coll
        self.reader = reader
        self.device = device
        self.running: dict[str, Running] = {}
        self.dtype: torch.dtype = next(model.parameters()).dtype

    def step(self, plan: Plan) -> StepOutcome:
        for rid in plan.drop:
            self.running.pop(rid, None)
        for rid, token in plan.feed:
            # A missing id here means the ranks diverged: fail loudly, never guess.
            self.running[rid].feed = token

        pixels, codes, messages = self._read_new(plan.new)
        failed_idx, active_per_rank = agree_on_failures(self.coll, codes, messages, active=len(self.running))
        if self.coll.rank == 0:
            # The agreement above is also the barrier that proves every rank
            # has copied the step's tensors: release them, success or not.
            for req in plan.new:
                for spec in req.pixel_values:
                    spec.release()
        failed = {}
        for i, req in enumerate(plan.new):
            if i in failed_idx:
                failed[req.request_id] = failed_idx[i]
            else:
                self.running[req.request_id] = Running(req, pixels[i], generator=self._generator(req))

        sampled = {}
        with torch.inference_mode():
            for rid, state in self.running.items():
                logits = self._forward(state)
                if self.coll.rank == 0:
                    sampled[rid] = self._sample(state, logits)
        return StepOutcome(sampled=sampled, failed=failed, active_per_rank=active_per_rank)

    def _read_new(self, new: tuple[NewRequest, ...]) -> tuple[list[list[torch.Tensor] | None], list[int], list[str]]:
        pixels: list[list[torch.Tensor] | None] = []
        codes: list[int] = []
        messages: list[str] = []
        for req in new:
            try:
                tensors = [self.reader.read(req.request_id, spec) for spec in req.pixel_values]
            except MmsplitError as exc:
                log.warning("rank %d could not read tensors of request %s: %s", self.coll.rank, req.request_id, exc)
                pixels.append(None)
                codes.append(exc.error_code)
                messages.append(exc.message)
                continue
            except Exception as exc:
                # A reader bug must not leave this rank out of the vote.
                log.exception("rank %d: tensor reader failed on request %s", self.coll.rank, req.request_id)
                pixels.append(None)
                codes.append(E.ERROR_CODE_FEATURE_TRANSPORT_FAILED)
                messages.append(f"{type(exc).__name__}: {exc}")
                continue
            pixels.append(tensors)
            codes.append(0)
            messages.append("")
        return pixels, codes, messages

    def _generator(self, req: NewRequest) -> torch.Generator | None:
        if self.coll.rank != 0 or req.temperature <= 0:
            return None
        gen = torch.Generator()
        gen.manual_seed(req.seed)
        return gen

    def _forward(self, state: Running) -> torch.Tensor:
        if state.cache is None:
            ids = torch.tensor([state.request.input_ids], dtype=torch.long, device=self.device)
            kwargs = {}
            if state.pixels:
                kwargs["pixel_values"] = torch.stack(state.pixels).to(self.device, self.dtype)
            state.cache = DynamicCache()
            out = self.model(input_ids=ids, past_key_values=state.cache, use_cache=True, **kwargs)
            state.pixels = None
        else:
            if state.feed is None:
                raise RuntimeError(f"request {state.request.request_id} has no token to feed")
            ids = torch.tensor([[state.feed]], dtype=torch.long, device=self.device)
            out = self.model(input_ids=ids, past_key_values=state.cache, use_cache=True)
        state.cache = out.past_key_values
        return out.logits[0, -1].float().cpu()

    @staticmethod
    def _sample(state: Running, logits: torch.Tensor) -> int:
        temperature = state.request.temperature
        if temperature <= 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=state.generator))
