"""Unit tests for actors.engine.decode_state: the decode worker's scheduler bookkeeping (no
torch)."""

from __future__ import annotations

from actors.engine.decode_state import (
    DecodeScheduler,
    SeqStatus,
    Sequence,
    finish_reason,
    finish_reason_of,
)
from actors.types import DecodeRequest, FinishReason, SamplingParams

EOS = 1


def remove_finished(sched: DecodeScheduler) -> list[int]:
    """What the decode engine does after a step, with the batch's rows kept in order: the rows
    that remain (the engine's BatchedKV.remove reorders them; test_kv checks that side)."""
    assert all(sched.running[i].status == SeqStatus.FINISHED for i in sched.finished_rows())
    keep = [i for i in range(len(sched.running)) if i not in set(sched.finished_rows())]
    sched.keep_rows(keep)
    return keep


def seq(
    rid: str, *, prompt: int = 5, first: int = 10, max_tokens: int = 16, stop=(EOS,)
) -> Sequence:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=tuple(stop))
    return Sequence(DecodeRequest(rid, prompt, first, params), kv=object())


def ids(seqs) -> list[str]:
    return [s.request_id for s in seqs]


def test_add_seeds_first_token_and_waits():
    sched = DecodeScheduler(max_batch_size=4, max_model_len=100)
    s = seq("a", prompt=7, first=42)
    sched.add(s)
    assert s.token_ids == [42]
    assert s.status == SeqStatus.WAITING
    assert s.next_position == 8
    assert sched.num_active == 1


def test_admission_respects_max_batch_size_and_fifo():
    sched = DecodeScheduler(max_batch_size=3, max_model_len=100)
    for i in range(5):
        sched.add(seq(f"r{i}"))
    joined = sched.admit()
    assert ids(joined) == ["r0", "r1", "r2"]
    assert all(s.status == SeqStatus.RUNNING for s in joined)
    assert ids(sched.running) == ["r0", "r1", "r2"]
    assert ids(sched.waiting) == ["r3", "r4"]
    assert sched.admit() == [], "a full batch admits nobody"
    # one finishes: exactly one slot opens, taken by the oldest waiter
    sched.running[1].status = SeqStatus.FINISHED
    assert remove_finished(sched) == [0, 2]
    assert ids(sched.admit()) == ["r3"]
    assert ids(sched.running) == ["r0", "r2", "r3"]
    assert ids(sched.waiting) == ["r4"]
    assert sched.num_active == 4


def test_record_finishes_on_stop_token():
    sched = DecodeScheduler(max_batch_size=4, max_model_len=100)
    a, b = seq("a", stop=(EOS, 2)), seq("b", stop=(EOS, 2))
    sched.add(a)
    sched.add(b)
    sched.admit()
    assert sched.record([50, 2]) == [b]
    assert b.status == SeqStatus.FINISHED and b.finish_reason == FinishReason.STOP
    assert a.status == SeqStatus.RUNNING and a.finish_reason is None
    assert a.token_ids == [10, 50] and b.token_ids == [10, 2]
    assert remove_finished(sched) == [0]
    assert sched.record([EOS]) == [a]
    assert a.finish_reason == FinishReason.STOP
    assert remove_finished(sched) == []
    assert sched.num_active == 0


def test_stop_token_only_counts_at_the_end():
    s = seq("a", stop=(EOS,))
    s.token_ids = [EOS, 7]  # an earlier EOS does not matter, only the newest token
    assert finish_reason(s, max_model_len=100) is None


def test_record_finishes_on_max_tokens():
    sched = DecodeScheduler(max_batch_size=4, max_model_len=1000)
    s = seq("a", max_tokens=3)
    sched.add(s)
    sched.admit()
    assert sched.record([11]) == []
    assert sched.record([12]) == [s]  # first token + 2 decoded = 3
    assert s.token_ids == [10, 11, 12]
    assert s.finish_reason == FinishReason.LENGTH


def test_stop_token_wins_over_length_on_the_same_step():
    sched = DecodeScheduler(max_batch_size=4, max_model_len=1000)
    s = seq("a", max_tokens=2)
    sched.add(s)
    sched.admit()
    assert sched.record([EOS]) == [s]
    assert s.finish_reason == FinishReason.STOP


def test_record_finishes_on_max_model_len():
    sched = DecodeScheduler(max_batch_size=4, max_model_len=8)
    s = seq("a", prompt=5, max_tokens=100)  # 5 prompt + first token = 6 of 8
    sched.add(s)
    sched.admit()
    assert sched.record([11]) == []  # 7 tokens
    assert sched.record([12]) == [s]  # 8 tokens = max_model_len
    assert s.finish_reason == FinishReason.LENGTH
    assert len(s.token_ids) == 3


def test_first_token_alone_can_finish_a_sequence():
    """The worker sweeps right after admit: a first token that is EOS (or max_tokens=1)
    must finish before any decode step."""
    sched = DecodeScheduler(max_batch_size=4, max_model_len=100)
    eos_first, one_token, normal = seq("e", first=EOS), seq("o", max_tokens=1), seq("n")
    for s in (eos_first, one_token, normal):
        sched.add(s)
    sched.admit()
    done = sched.sweep()
    assert done == [eos_first, one_token]
    assert eos_first.finish_reason == FinishReason.STOP
    assert one_token.finish_reason == FinishReason.LENGTH
    assert remove_finished(sched) == [2]
    assert ids(sched.running) == ["n"]


def test_aborted_waiting_sequences_are_never_admitted():
    sched = DecodeScheduler(max_batch_size=2, max_model_len=100)
    for rid in ("a", "b", "c", "d"):
        sched.add(seq(rid))
    sched.abort("a")
    sched.abort("c")
    joined = sched.admit()
    assert ids(joined) == ["b", "d"], "aborted waiters must not take batch slots"
    assert ids(sched.running) == ["b", "d"]
    assert not sched.waiting
    assert sched.num_active == 2


def test_abort_of_unknown_request_is_a_no_op():
    sched = DecodeScheduler(max_batch_size=2, max_model_len=100)
    sched.add(seq("a"))
    sched.abort("nope")
    assert ids(sched.admit()) == ["a"]


def test_aborted_running_sequences_are_swept():
    sched = DecodeScheduler(max_batch_size=4, max_model_len=100)
    for rid in ("a", "b", "c"):
        sched.add(seq(rid))
    sched.admit()
    sched.abort("b")
    done = sched.sweep()
    assert ids(done) == ["b"]
    assert done[0].finish_reason == FinishReason.ABORT
    assert done[0].status == SeqStatus.FINISHED
    assert remove_finished(sched) == [0, 2]
    assert ids(sched.running) == ["a", "c"]


def test_abort_wins_over_stop_token():
    sched = DecodeScheduler(max_batch_size=4, max_model_len=100)
    s = seq("a")
    sched.add(s)
    sched.admit()
    sched.abort("a")
    assert sched.record([EOS]) == [s]
    assert s.finish_reason == FinishReason.ABORT


def test_remove_finished_returns_kept_rows_in_order():
    sched = DecodeScheduler(max_batch_size=8, max_model_len=100)
    for i in range(6):
        sched.add(seq(f"r{i}", stop=(EOS,)))
    sched.admit()
    done = sched.record([EOS, 20, EOS, 21, 22, EOS])
    assert ids(done) == ["r0", "r2", "r5"]
    assert remove_finished(sched) == [1, 3, 4]
    assert ids(sched.running) == ["r1", "r3", "r4"]
    # the running list and the kept rows stay aligned for the next step
    assert sched.record([EOS, 30, 31]) == [sched.running[0]]
    assert remove_finished(sched) == [1, 2]
    assert ids(sched.running) == ["r3", "r4"]
    assert [s.token_ids for s in sched.running] == [[10, 21, 30], [10, 22, 31]]


def test_a_row_that_could_not_be_sampled_ends_alone_with_error():
    sched = DecodeScheduler(max_batch_size=4, max_model_len=64)
    a, b, c = seq("a"), seq("b"), seq("c")
    for s in (a, b, c):
        sched.add(s)
    sched.admit()
    assert sched.record([11, None, 12]) == [b]
    assert b.finish_reason == FinishReason.ERROR and b.token_ids == [10]
    assert remove_finished(sched) == [0, 2]
    assert sched.record([13, 14]) == [] and a.token_ids == [10, 11, 13]


def test_finish_reason_of_tokens_already_produced():
    """What a resumed request checks before prefilling again: a worker that died after the
    last token must not cost one more token."""
    params = SamplingParams(temperature=0.0, max_tokens=3, stop_token_ids=(EOS,))
    assert finish_reason_of(5, params, [10, 11], max_model_len=64) is None
    assert finish_reason_of(5, params, [10, 11, 12], max_model_len=64) == FinishReason.LENGTH
    assert finish_reason_of(5, params, [10, EOS], max_model_len=64) == FinishReason.STOP
    assert finish_reason_of(61, params, [10, 11], max_model_len=63) == FinishReason.LENGTH


def test_history_is_prompt_plus_every_generated_token_only_when_needed():
    from actors.engine.prefill import history_of
    from actors.types import PrefillRequest, TokenHistory

    plain = seq("a")
    assert plain.history() == TokenHistory(), "no penalty: nothing to carry"
    params = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    resumed = Sequence(
        DecodeRequest("b", 7, 30, params, history=TokenHistory((1, 2, 3, 4, 5), (20, 21))),
        kv=object(),
    )
    sched = DecodeScheduler(max_batch_size=4, max_model_len=100)
    sched.add(resumed)
    sched.admit()
    sched.record([31])
    assert resumed.history() == TokenHistory((1, 2, 3, 4, 5), (20, 21, 30, 31))
    # prefill of that resumed request: its last two prompt tokens were generated output
    request = PrefillRequest("b", (1, 2, 3, 4, 5, 20, 21), (), params, num_output_tokens=2)
    assert history_of(request) == TokenHistory((1, 2, 3, 4, 5), (20, 21))
    assert history_of(PrefillRequest("c", (1, 2), (), SamplingParams())) is None


def sized(rid: str, kv_bytes: int, **kwargs) -> Sequence:
    s = seq(rid, **kwargs)
    s.kv_bytes = kv_bytes
    return s


def test_kv_budget_admits_only_what_fits_oldest_first():
    sched = DecodeScheduler(max_batch_size=8, max_model_len=100, kv_budget_bytes=100)
    for rid, size in (("a", 40), ("b", 50), ("c", 30), ("d", 5)):
        sched.add(sized(rid, size))
    assert ids(sched.admit()) == ["a", "b"] and sched.kv_reserved_bytes == 90
    assert ids(sched.waiting) == ["c", "d"], "d would fit, but nobody overtakes c (no starvation)"
    sched.admit()
    assert sched.num_waited_for_kv == 1  # c, counted once however many steps it waits
    sched.running[0].status = SeqStatus.FINISHED  # a leaves: its 40 bytes return
    assert remove_finished(sched) == [1] and sched.kv_reserved_bytes == 50
    assert ids(sched.admit()) == ["c", "d"] and sched.kv_reserved_bytes == 85


def test_a_sequence_alone_runs_whatever_its_size():
    sched = DecodeScheduler(max_batch_size=8, max_model_len=100, kv_budget_bytes=100)
    sched.add(sized("huge", 500))
    sched.add(sized("small", 1))
    assert ids(sched.admit()) == ["huge"], "an empty batch must never stall"
    assert sched.admit() == []


def test_aborted_waiters_leave_the_line_and_reserve_nothing():
    sched = DecodeScheduler(max_batch_size=8, max_model_len=100, kv_budget_bytes=100)
    for rid, size in (("a", 90), ("b", 50), ("c", 10)):
        sched.add(sized(rid, size))
    sched.admit()
    sched.abort("b")
    assert ids(sched.admit()) == ["c"] and sched.kv_reserved_bytes == 100
    assert ids(sched.waiting) == []
    assert len(sched.clear()) == 2 and sched.kv_reserved_bytes == 0


def test_no_budget_means_rows_are_the_only_limit():
    sched = DecodeScheduler(max_batch_size=2, max_model_len=100)
    for rid in "abc":
        sched.add(sized(rid, 10**12))
    assert ids(sched.admit()) == ["a", "b"]
