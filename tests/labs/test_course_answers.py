"""The course's newer compute exercises (03.2, 07.2, 08.2, 13.2, 14.3, 15.3): each reference answer, worked out with
kvexplore, equals a formula worked out here by hand from the config and the notebook's reasoning."""

from __future__ import annotations

import kvexplore
from kvexplore.course import solutions


def _tiny():
    return kvexplore.load("tiny").config


def test_03_2_a_step_without_a_cache_recomputes_the_past_keys_and_values():
    c = _tiny()
    per_token = c.hidden_size * 2 * c.num_kv_heads * c.head_dim  # k_proj and v_proj, one layer
    assert solutions.answer("03.2") == (256 - 1) * c.num_layers * per_token == 50_135_040


def test_07_2_stale_reads_spoil_every_decode_position_after_them():
    # positions 10..22 read stale slots (the old sequence reached 24); what layer 0 got wrong there became keys of the
    # layers above, which every later step reads: all 20 decode positions part, the prompt's 10 (masked) do not
    assert solutions.answer("07.2") == len(range(10, 30)) == 20


def test_08_2_gemma3_1b_holds_its_full_layers_and_its_windows():
    per_position = 2 * 1 * 256 * 2                                  # K and V, 1 KV head of 256, bfloat16
    full = [i for i in range(26) if (i + 1) % 6 == 0]               # layers 5, 11, 17, 23
    assert len(full) == 4
    assert solutions.answer("08.2") == per_position * (4 * 6000 + 22 * 512) == 36_110_336


def test_13_2_a_shared_system_prompt_saves_the_later_requests_whole_blocks():
    c = _tiny()
    page = 2 * c.num_layers * c.num_kv_heads * 16 * c.head_dim * 4  # float32
    assert solutions.answer("13.2") == (4 - 1) * (70 // 16) * page == 589_824


def test_14_3_q8_0_keys_and_q4_0_values():
    c = _tiny()
    blocks = c.num_layers * c.num_kv_heads * c.head_dim * 256 // 32  # of keys, and as many of values
    assert solutions.answer("14.3") == blocks * (32 + 2) + blocks * (16 + 2) == 159_744


def test_15_3_a_ring_short_of_its_window_parts_when_it_first_wraps():
    from kvexplore.bugs.models import WINDOW
    from kvexplore.bugs.windows import EARLY

    assert solutions.answer("15.3") == WINDOW - EARLY == 8  # position 8 overwrites position 0, still in the window
