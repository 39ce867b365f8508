"""A decode step's text model without transformers' module calls around
its layers, bit for bit the same (`--lean-decode`).

A decode step feeds one token per running row through every layer. On a
CPU the model's own arithmetic for one row of the 8x512 model is ~6 ms of
matrix products; transformers' forward adds ~1 ms around it: a module call
per norm, projection and MLP (each with its hook checks), the model's
output-capturing and config decorators, the mask builder. Without them a
one-row decode step takes 0.92x as long there, the tiny model's 0.81x
(`bench/step_profile.py`).
`LeanLlama` makes the same operations, on the same weights, in the same
order, as transformers' Llama layers (the text model of the LLaVA
families) and Qwen2's (InternVL3's: Llama's with biased projections, which
their `forward` adds), `LeanQwen3` as Qwen3's (InternVL3.5's: with a norm
over each head's queries and keys), `LeanQwen2VL` as Qwen2-VL's and Qwen2.5-VL's (the same layers,
with M-RoPE positions) and `LeanQwen3VL` as Qwen3-VL's (with a norm over
each head's queries and keys). It calls the model's own pieces: the
embedding, the rotary embedding and `apply_rotary_pos_emb` of the model's
modeling module, the attention function (`config._attn_implementation`),
each norm's, projection's and activation's `forward`. Only the layers'
glue is written here, and the module calls between the pieces go.

It stands in for the model's forward only where nothing could tell:

- under TP too: transformers' plan puts its own `forward` on each
  projection it shards (the rowwise ones, o_proj and down_proj, sum the
  ranks' partial outputs inside it), and the lean body calls each
  projection's `forward` as the layer does, so it makes the same sums in
  the same order on every rank;
- a text model, and parts, of exactly the classes it copies
  (`_architectures`; Qwen3-VL-MoE's, with its experts, is not one), no
  sliding-window layers, in eval mode;
- at start-up, a probe (a prefill of a few tokens, then a decode step, in
  a scratch cache) makes bit-identical hidden states both ways: a
  transformers version whose layers differ, a kernel that replaced a
  forward, or an attention function that reads what we do not pass
  leaves the model's own forward in place (logged);
- on every call, no module it skips has a forward hook, or a forward
  set on the instance since it was made (tests' fault injection, an
  offload hook; the TP plan's, set before, are the model's own): that
  call goes through the model's own forward.

Prefill forwards stay the model's own: their matrix products are large
enough that the calls around them do not count.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.nn.modules import module as torch_module

log = logging.getLogger(__name__)

# A scratch cache for the probe: (layers) -> a `transformers.Cache` that the
# engine's `RowCache` is (begin_prefill / begin_decode / update).
CacheFactory = Callable[[int], Any]

PROBE_TOKENS = 5


class Hidden(NamedTuple):
    """What the engine reads of a body's output."""

    last_hidden_state: torch.Tensor


class _Layer(NamedTuple):
    layer: Any
    attn: Any
    input_norm: Any
    q: torch.nn.Linear
    k: torch.nn.Linear
    v: torch.nn.Linear
    o: torch.nn.Linear
    post_norm: Any
    gate: torch.nn.Linear
    up: torch.nn.Linear
    down: torch.nn.Linear
    act: Callable[[torch.Tensor], torch.Tensor]


class LeanLlama:
    """transformers' `LlamaModel.forward` for the engine's calls (input ids,
    positions, an additive 4-D mask, the engine's cache), without the module
    calls between its operations. Subclasses differ only in how positions
    reach the rotary embedding and what the attention function is given."""

    def __init__(self, body: torch.nn.Module) -> None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.body = body
        config: Any = body.config
        # The model's own functions, from its modeling module, as its attention calls them.
        modeling = importlib.import_module(type(body.layers[0].self_attn).__module__)  # type: ignore[index,union-attr]
        self._rotary = modeling.apply_rotary_pos_emb
        self._attention = ALL_ATTENTION_FUNCTIONS.get_interface(
            config._attn_implementation, modeling.eager_attention_forward
        )
        self._layers = [
            _Layer(
                layer,
                layer.self_attn,
                layer.input_layernorm,
                layer.self_attn.q_proj,
                layer.self_attn.k_proj,
                layer.self_attn.v_proj,
                layer.self_attn.o_proj,
                layer.post_attention_layernorm,
                layer.mlp.gate_proj,
                layer.mlp.up_proj,
                layer.mlp.down_proj,
                layer.mlp.act_fn,
            )
            for layer in body.layers[: config.num_hidden_layers]  # type: ignore[index,union-attr]
        ]
        # The modules whose calls this skips: a hook on any of them, or a
        # forward set on one since (the TP plan's are set as the model
        # loads), sends a call through the model's own forward. Their hook
        # dicts (torch adds a hook to the module's own dict, in place) and
        # instance dicts, held to check every call in C's loops.
        skipped = self._skipped()
        self._hook_dicts = tuple(d for m in skipped for d in (m._forward_hooks, m._forward_pre_hooks))
        self._instance_dicts = tuple(m.__dict__ for m in skipped)
        self._forwards = tuple(d.get("forward") for d in self._instance_dicts)

    def _skipped(self) -> list[torch.nn.Module]:
        body: Any = self.body
        skipped: list[torch.nn.Module] = [body, body.norm]
        for parts in self._layers:
            skipped += [parts.layer, parts.attn, parts.input_norm, parts.post_norm, parts.layer.mlp]
            skipped += [parts.q, parts.k, parts.v, parts.o, parts.gate, parts.up, parts.down]
        return skipped

    def observed(self) -> bool:
        """Whether anything would see the skipped calls (then the model's own forward runs)."""
        if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks or any(self._hook_dicts):
            return True
        return any(d.get("forward") is not f for d, f in zip(self._instance_dicts, self._forwards, strict=True))

    def __call__(
        self,
        *,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        past_key_values: Any,
        use_cache: bool = True,
        **extra: Any,
    ) -> Any:
        if extra or self.observed():
            return self.body(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=attention_mask,
                past_key_values=past_key_values,
                use_cache=use_cache,
                **extra,
            )
        return Hidden(self.forward(input_ids, position_ids, attention_mask, past_key_values, use_cache))

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: Any,
        use_cache: bool,
    ) -> torch.Tensor:
        body: Any = self.body
        hidden = body.embed_tokens(input_ids)
        rope_positions, text_positions = self._positions(position_ids)
        cos, sin = body.rotary_emb(hidden, rope_positions)
        shape = hidden.shape[:-1]
        for p in self._layers:
            residual = hidden
            normed = p.input_norm.forward(hidden)
            q, k, v = self._qkv(p, normed, (*shape, -1, p.attn.head_dim))
            q, k = self._rotary(q, k, cos, sin)
            k, v = cache.update(k, v, p.attn.layer_idx)
            out, _ = self._attention(
                p.attn,
                q,
                k,
                v,
                attention_mask,
                dropout=0.0,
                scaling=p.attn.scaling,
                **self._attention_extra(p.attn, text_positions, use_cache),
            )
            out = out.reshape(*shape, -1).contiguous()
            hidden = residual + p.o.forward(out)
            residual = hidden
            normed = p.post_norm.forward(hidden)
            hidden = residual + p.down.forward(p.act(p.gate.forward(normed)) * p.up.forward(normed))
        return body.norm.forward(hidden)  # type: ignore[no-any-return]

    def _qkv(self, p: _Layer, normed: torch.Tensor, heads: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        """The queries, keys and values, ``[rows, heads, tokens, head dim]``, before the rotary embedding."""
        return tuple(proj.forward(normed).view(heads).transpose(1, 2) for proj in (p.q, p.k, p.v))

    def _positions(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(what the rotary embedding is given, what the attention function is given)."""
        return position_ids, position_ids

    def _attention_extra(self, attn: Any, text_positions: torch.Tensor | None, use_cache: bool) -> dict[str, Any]:
        """What the attention function is given besides the model's tensors, as the model's layers give it."""
        return {"position_ids": text_positions, "use_cache": use_cache}


class LeanQwen2VL(LeanLlama):
    """`Qwen2VLTextModel.forward` (Qwen2-VL's and Qwen2.5-VL's text model):
    Llama's layers with M-RoPE positions (three rows: time, height, width;
    a fourth first one, where given, is the text positions for the
    attention function) and each attention's sliding window passed on."""

    # Rows a 2-D position tensor is expanded to (Qwen3-VL's text model takes
    # the text positions' row from it as well).
    POSITION_ROWS = 3

    def _positions(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if position_ids.ndim == 2:
            position_ids = position_ids[None, ...].expand(self.POSITION_ROWS, position_ids.shape[0], -1)
        if position_ids.ndim == 3 and position_ids.shape[0] == 4:
            return position_ids[1:], position_ids[0]
        return position_ids, None

    def _attention_extra(self, attn: Any, text_positions: torch.Tensor | None, use_cache: bool) -> dict[str, Any]:
        return {"sliding_window": attn.sliding_window, "position_ids": text_positions, "use_cache": use_cache}


class _HeadNorms(LeanLlama):
    """Qwen3's attention: an RMSNorm over each head's queries and keys before the rotary embedding."""

    def _skipped(self) -> list[torch.nn.Module]:
        return super()._skipped() + [norm for p in self._layers for norm in (p.attn.q_norm, p.attn.k_norm)]

    def _qkv(self, p: _Layer, normed: torch.Tensor, heads: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        q = p.attn.q_norm.forward(p.q.forward(normed).view(heads)).transpose(1, 2)
        k = p.attn.k_norm.forward(p.k.forward(normed).view(heads)).transpose(1, 2)
        return q, k, p.v.forward(normed).view(heads).transpose(1, 2)


class LeanQwen3(_HeadNorms):
    """`Qwen3Model.forward` (InternVL3.5's text model): Llama's layers with
    the head norms, and each attention's sliding window passed on."""

    def _attention_extra(self, attn: Any, text_positions: torch.Tensor | None, use_cache: bool) -> dict[str, Any]:
        return {"sliding_window": attn.sliding_window, "position_ids": text_positions, "use_cache": use_cache}


class LeanQwen3VL(_HeadNorms, LeanQwen2VL):
    """`Qwen3VLTextModel.forward`: Llama's layers with the head norms,
    M-RoPE positions (four rows, the text positions first), and no
    `use_cache` passed to the layers (so the attention function sees the
    layer's default, False). Its decode steps have no deepstack features
    (those add to the image positions of a prefill)."""

    POSITION_ROWS = 4

    def _attention_extra(self, attn: Any, text_positions: torch.Tensor | None, use_cache: bool) -> dict[str, Any]:
        return {"position_ids": text_positions, "use_cache": False}


class _Architecture(NamedTuple):
    """The classes of a text model's parts that a lean body copies."""

    layer: type
    attn: type
    mlp: type
    norm: type
    rotary: type
    lean: type[LeanLlama]


def _architectures() -> dict[type, _Architecture]:
    """By the text model's class (exactly: a subclass may compute otherwise)."""
    from transformers.models.llama import modeling_llama as llama
    from transformers.models.qwen2 import modeling_qwen2 as qwen2_text
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as qwen25
    from transformers.models.qwen2_vl import modeling_qwen2_vl as qwen2
    from transformers.models.qwen3 import modeling_qwen3 as qwen3_text
    from transformers.models.qwen3_vl import modeling_qwen3_vl as qwen3

    return {
        llama.LlamaModel: _Architecture(
            llama.LlamaDecoderLayer, llama.LlamaAttention, llama.LlamaMLP, llama.LlamaRMSNorm,
            llama.LlamaRotaryEmbedding, LeanLlama,
        ),
        # InternVL's text model (Llama's layers with biased q, k, v projections).
        qwen2_text.Qwen2Model: _Architecture(
            qwen2_text.Qwen2DecoderLayer, qwen2_text.Qwen2Attention, qwen2_text.Qwen2MLP, qwen2_text.Qwen2RMSNorm,
            qwen2_text.Qwen2RotaryEmbedding, LeanLlama,
        ),
        # InternVL3.5's (Qwen3: the head norms).
        qwen3_text.Qwen3Model: _Architecture(
            qwen3_text.Qwen3DecoderLayer, qwen3_text.Qwen3Attention, qwen3_text.Qwen3MLP, qwen3_text.Qwen3RMSNorm,
            qwen3_text.Qwen3RotaryEmbedding, LeanQwen3,
        ),
        qwen2.Qwen2VLTextModel: _Architecture(
            qwen2.Qwen2VLDecoderLayer, qwen2.Qwen2VLAttention, qwen2.Qwen2MLP, qwen2.Qwen2VLRMSNorm,
            qwen2.Qwen2VLRotaryEmbedding, LeanQwen2VL,
        ),
        qwen25.Qwen2_5_VLTextModel: _Architecture(
            qwen25.Qwen2_5_VLDecoderLayer, qwen25.Qwen2_5_VLAttention, qwen25.Qwen2MLP, qwen25.Qwen2_5_VLRMSNorm,
            qwen25.Qwen2_5_VLRotaryEmbedding, LeanQwen2VL,
        ),
        qwen3.Qwen3VLTextModel: _Architecture(
            qwen3.Qwen3VLTextDecoderLayer, qwen3.Qwen3VLTextAttention, qwen3.Qwen3VLTextMLP, qwen3.Qwen3VLTextRMSNorm,
            qwen3.Qwen3VLTextRotaryEmbedding, LeanQwen3VL,
        ),
    }  # fmt: skip


def _copied(body: torch.nn.Module, arch: _Architecture) -> bool:
    """Whether every part of `body` is of the class `arch` copies (its
    projections plain `nn.Linear`), with no sliding-window layers."""
    config: Any = body.config
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return False
    layers: Any = body.layers
    for layer in layers:
        parts = (layer, layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm)
        if tuple(map(type, parts)) != (arch.layer, arch.attn, arch.mlp, arch.norm, arch.norm):
            return False
        # Plain projections only: a quantized one multiplies in its own forward, not by its weight.
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if any(type(proj) is not torch.nn.Linear for proj in projections):
            return False
    return type(body.norm) is arch.norm and type(body.rotary_emb) is arch.rotary  # type: ignore[union-attr]


def lean_decode_body(body: torch.nn.Module, *, make_cache: CacheFactory) -> Any:
    """`body` itself, or a `LeanLlama` over it where it may stand in (the
    module docstring's conditions), with the reason logged either way.
    Under TP every rank calls it as the group starts: the probe's forwards
    make their sums together."""
    arch = _architectures().get(type(body))
    why = ""
    if arch is None or not _copied(body, arch):
        why = f"its text model ({type(body).__name__}) is not one whose layers it copies"
    elif body.training:
        why = "the model is in training mode"
    if why:
        log.info("decode steps run the model's own forward: %s", why)
        return body
    assert arch is not None
    lean = arch.lean(body)
    differs = _probe(lean, body, make_cache)
    if differs:
        log.warning("decode steps run the model's own forward: the lean decode %s", differs)
        return body
    log.info("decode steps run the model's operations without its module calls (--lean-decode)")
    return lean


def _probe(lean: LeanLlama, body: torch.nn.Module, make_cache: CacheFactory) -> str:
    """'' where `lean` makes bit-identical hidden states to `body` over a
    prefill of a few tokens and one decode step; else what differed."""
    if lean.observed():
        return "could not be checked: the model has forward hooks at start-up"
    config: Any = body.config
    device: Any = body.embed_tokens.weight.device  # type: ignore[union-attr]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (1, PROBE_TOKENS + 1), generator=generator).to(device)

    def own(ids: torch.Tensor, inputs: Any, cache: Any) -> torch.Tensor:
        out = body(input_ids=ids, position_ids=inputs.position_ids, attention_mask=inputs.attention_mask,
                   past_key_values=cache, use_cache=True)  # fmt: skip
        return out.last_hidden_state  # type: ignore[no-any-return]

    def lean_own(ids: torch.Tensor, inputs: Any, cache: Any) -> torch.Tensor:
        return lean.forward(ids, inputs.position_ids, inputs.attention_mask, cache, True)

    made = []
    with torch.inference_mode():
        for forward in (own, lean_own):
            cache = make_cache(config.num_hidden_layers)
            prefill = forward(ids[:, :PROBE_TOKENS], cache.begin_prefill([PROBE_TOKENS]), cache)
            made.append((prefill, forward(ids[:, PROBE_TOKENS:], cache.begin_decode(), cache)))
    for what, theirs, ours in zip(("a prefill", "a decode step"), *made, strict=True):
        if not torch.equal(theirs, ours):
            most = (theirs - ours).abs().max().item()
            return f"made other hidden states than the model's own forward in {what} (by up to {most:.3g})"
    return ""
