"""The row-compact KV cache: masks and positions, joins, leaves, row order,
growth, and batched decode equal to each request decoded alone."""

from __future__ import annotations

import random

import pytest
import torch

from scheduler_svc.kvcache import RowCache

MIN = torch.finfo(torch.float32).min


def cache(**kw: int) -> RowCache:
    return RowCache(1, dtype=torch.float32, device=torch.device("cpu"), **kw)


def fill(c: RowCache, rows: int, q_len: int, value: float) -> None:
    """Stand in for a forward: one layer's update with recognisable keys."""
    states = torch.full((rows, 2, q_len, 4), value)
    c.update(states, states.clone(), 0)


def test_prefill_mask_is_causal_and_hides_padding() -> None:
    c = cache()
    inputs = c.begin_prefill([3, 1])
    assert inputs.position_ids.tolist() == [[0, 1, 2], [0, 1, 2]]
    visible = (inputs.attention_mask == 0).squeeze(1)
    assert visible[0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    # Row 1 has one real token: every query (padding too) sees key 0 only.
    assert visible[1].tolist() == [[True, False, False]] * 3
    assert inputs.attention_mask[0, 0, 0, 1].item() == MIN
    assert c.lengths == [3, 1]


def test_decode_gives_each_row_its_own_position_and_visible_keys() -> None:
    c = cache()
    c.begin_prefill([3, 1])
    fill(c, 2, 3, 1.0)
    inputs = c.begin_decode()
    assert inputs.position_ids.tolist() == [[3], [1]]
    visible = (inputs.attention_mask == 0)[:, 0, 0]
    assert visible.tolist() == [[True] * 4, [True, True, False, False]]
    assert c.lengths == [4, 2]


def test_padded_decode_keys_repeat_their_shape_and_hide_the_padding() -> None:
    c = cache()
    c.decode_kv_multiple = 8
    c.begin_prefill([3, 1])
    fill(c, 2, 3, 1.0)
    shapes = []
    for _ in range(6):
        inputs = c.begin_decode()
        shapes.append(inputs.attention_mask.shape[-1])
    assert shapes == [8, 8, 8, 8, 8, 16]  # the longest row: 4, 5, ... 9 keys
    visible = (inputs.attention_mask == 0)[:, 0, 0]
    assert visible.sum(-1).tolist() == [9, 7]
    assert not visible[:, 9:].any()


def test_decode_writes_each_rows_token_at_its_own_length() -> None:
    c = cache()
    c.begin_prefill([3, 1])
    fill(c, 2, 3, 1.0)
    c.begin_decode()
    new = torch.stack([torch.full((2, 1, 4), 7.0), torch.full((2, 1, 4), 9.0)])
    keys, _ = c.update(new, new.clone(), 0)
    assert keys.shape == (2, 2, 4, 4)  # rows, heads, longest row + 1, head dim
    assert keys[0, 0, :, 0].tolist() == [1.0, 1.0, 1.0, 7.0]
    assert keys[1, 0, :2, 0].tolist() == [1.0, 9.0]


def test_remove_moves_the_last_row_into_the_hole_and_clears_the_vacated_slot() -> None:
    c = cache()
    for value, length in ((1.0, 2), (2.0, 3), (3.0, 4)):
        c.begin_prefill([length])
        fill(c, 1, length, value)
    c.remove(0)
    assert c.lengths == [4, 3]
    c.begin_decode()
    keys, _ = c.update(torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4), 0)
    assert keys[0, 0, 0, 0].item() == 3.0  # the former last row now sits in row 0
    assert keys[1, 0, 0, 0].item() == 2.0
    # The slot the last row left is zero (a NaN left there could reach a later row).
    c.remove(1)
    c.begin_prefill([1])
    assert c._keys[0] is not None
    assert torch.count_nonzero(c._keys[0][1]).item() == 0


def test_capacity_grows_in_chunks_keeps_the_rows_and_is_freed_when_empty() -> None:
    c = cache(token_chunk=8, row_chunk=2)
    c.begin_prefill([5])
    fill(c, 1, 5, 4.0)
    assert (c.row_capacity, c.token_capacity) == (2, 8)
    for _ in range(3):
        c.begin_decode()
        fill(c, 1, 1, 5.0)
    assert c.token_capacity == 8  # 8 tokens held, none past capacity yet
    c.begin_decode()
    fill(c, 1, 1, 6.0)
    assert c.token_capacity == 16  # grew by one chunk
    c.begin_prefill([2, 2])
    fill(c, 2, 2, 8.0)
    assert c.row_capacity == 4
    assert c._keys[0] is not None
    assert c._keys[0][0, 0, :9, 0].tolist() == [4.0] * 5 + [5.0] * 3 + [6.0]
    for row in (2, 1, 0):
        c.remove(row)
    assert (c.rows, c.row_capacity, c.token_capacity, c.nbytes()) == (0, 0, 0, 0)


def test_a_growth_made_ahead_is_zeroed_a_share_a_step_and_then_only_copies_the_rows() -> None:
    """A long row's adoption grows every row to its length: made ahead
    (`grow_ahead`) and zeroed over the steps before (`advance_growth`), the
    growth keeps the rows, leaves every other position zero, and uses the
    storage made ahead (no allocation at the adoption)."""
    c = cache(token_chunk=8, row_chunk=2)
    for value, length in ((1.0, 3), (2.0, 5)):
        c.begin_prefill([length])
        fill(c, 1, length, value)
    long = cache(token_chunk=8, row_chunk=1)
    long.begin_prefill([20])
    fill(long, 1, 20, 9.0)
    c.grow_ahead(20, steps=2)
    made = c._growth
    assert made is not None
    assert (made.rows, made.tokens, len(made.stores)) == (4, 24, 2)  # one more row; keys and values
    ahead = [t for _, _, t in made.stores]
    for t in ahead:
        t.fill_(float("nan"))  # what uninitialized memory may hold: it must all be zeroed
    c.advance_growth()
    assert made.zeroed == 1
    c.begin_decode()  # rows still decode meanwhile (within the old capacity)
    fill(c, 2, 1, 3.0)
    c.adopt(long)
    assert c._growth is None
    assert c._keys[0] is ahead[0]
    assert c._values[0] is ahead[1], "the share not zeroed ahead is zeroed at the growth"
    assert (c.row_capacity, c.token_capacity, c.lengths) == (4, 24, [4, 6, 20])
    keys = c._keys[0]
    assert keys[0, 0, :5, 0].tolist() == [1.0, 1.0, 1.0, 3.0, 0.0]
    assert keys[1, 0, :7, 0].tolist() == [2.0] * 5 + [3.0, 0.0]
    assert keys[2, 0, :21, 0].tolist() == [9.0] * 20 + [0.0]
    for t in (keys, c._values[0]):
        assert torch.isfinite(t).all()
        assert float(t[:, :, 21:].abs().sum()) == 0.0
        assert float(t[3].abs().sum()) == 0.0


def test_row_blocks_are_the_row_s_keys_and_values_block_by_block_each_owning_its_memory() -> None:
    """Every position's keys and values distinct (layer, kind, head, token,
    dim all in the value): each block is the row's slice at its tokens, laid
    out ``[layers, 2, heads, size, dim]``; a block holds only its own bytes
    (the prefix cache's byte count is what eviction frees); the blocks put
    back in a row give the row's keys and values again."""
    layers, heads, dim, length = 3, 2, 4, 40
    c = RowCache(layers, dtype=torch.float32, device=torch.device("cpu"), token_chunk=8, row_chunk=2)
    c.begin_prefill([length, 5])
    grid = torch.arange(heads * length * dim, dtype=torch.float32).reshape(1, heads, length, dim)
    for layer in range(layers):
        keys = torch.cat([grid, torch.full((1, heads, length, dim), -1.0)]) + 1000 * layer
        c.update(keys, keys + 100_000, layer)
    blocks = c.row_blocks(0, 8, 40, 16)
    assert blocks is not None
    assert len(blocks) == 2
    for b, block in enumerate(blocks):
        assert block.shape == (layers, 2, heads, 16, dim)
        assert block.untyped_storage().nbytes() == block.nbytes
        at = 8 + 16 * b
        for layer in range(layers):
            want = grid[0, :, at : at + 16] + 1000 * layer
            assert torch.equal(block[layer, 0], want)
            assert torch.equal(block[layer, 1], want + 100_000)
    with pytest.raises(ValueError, match="whole number"):
        c.row_blocks(0, 0, 20, 16)
    every = c.row_blocks(0, 0, 32, 16)
    assert every is not None
    c.append_row(torch.cat(every, dim=3))
    for layer in range(layers):
        stored = c._keys[layer]
        assert stored is not None
        assert torch.equal(stored[2, :, :32], stored[0, :, :32])


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
    )
    return LlamaForCausalLM(config).eval()


def alone(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens by recomputing the whole sequence each step: no cache,
    no batch, nothing shared with the code under test."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))  # type: ignore[operator]
    return seq[len(prompt) :]


@pytest.mark.parametrize("kv_multiple", [1, 24], ids=["keys as long as the longest row", "keys padded"])
def test_continuous_joins_and_leaves_decode_like_each_request_alone(llama: torch.nn.Module, kv_multiple: int) -> None:
    """Requests join in batches at random steps and leave when done; every
    one of them makes the tokens it makes alone (also with a decode step's
    keys padded, masked, past the longest row: `decode_kv_multiple`)."""
    rng = random.Random(3)
    requests = [([rng.randrange(1, 300) for _ in range(rng.randrange(1, 40))], rng.randrange(1, 20)) for _ in range(16)]
    c = RowCache(
        2, dtype=torch.float32, device=torch.device("cpu"), token_chunk=16, row_chunk=4, decode_kv_multiple=kv_multiple
    )
    rows: list[int] = []  # request index per cache row
    feeds: list[int] = []
    made: dict[int, list[int]] = {i: [] for i in range(len(requests))}
    waiting = list(range(len(requests)))
    with torch.inference_mode():
        while waiting or rows:
            if rows:
                inputs = c.begin_decode()
                hidden = llama.model(  # type: ignore[operator]
                    input_ids=torch.tensor(feeds)[:, None],
                    position_ids=inputs.position_ids,
                    attention_mask=inputs.attention_mask,
                    past_key_values=c,
                    use_cache=True,
                ).last_hidden_state
                feeds = llama.lm_head(hidden[:, -1]).argmax(-1).tolist()  # type: ignore[operator]
                for r, token in zip(rows, feeds, strict=True):
                    made[r].append(token)
            joining = [waiting.pop(0) for _ in range(min(len(waiting), rng.randrange(0, 4)))]
            if joining:
                lengths = [len(requests[j][0]) for j in joining]
                ids = torch.zeros(len(joining), max(lengths), dtype=torch.long)
                for k, j in enumerate(joining):
                    ids[k, : lengths[k]] = torch.tensor(requests[j][0])
                inputs = c.begin_prefill(lengths)
                hidden = llama.model(  # type: ignore[operator]
                    input_ids=ids,
                    position_ids=inputs.position_ids,
                    attention_mask=inputs.attention_mask,
                    past_key_values=c,
                    use_cache=True,
                ).last_hidden_state
                last = hidden[torch.arange(len(joining)), torch.tensor(lengths) - 1]
                for j, token in zip(joining, llama.lm_head(last).argmax(-1).tolist(), strict=True):  # type: ignore[operator]
                    made[j].append(token)
                    rows.append(j)
                    feeds.append(token)
            # Leave in row order; the cache and our lists swap-remove alike.
            k = 0
            while k < len(rows):
                if len(made[rows[k]]) >= requests[rows[k]][1]:
                    c.remove(k)
                    rows[k], feeds[k] = rows[-1], feeds[-1]
                    rows.pop()
                    feeds.pop()
                else:
                    k += 1
        expected = {i: alone(llama, prompt, n) for i, (prompt, n) in enumerate(requests)}
    assert made == expected
    assert c.rows == 0
