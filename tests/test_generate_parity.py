"""Greedy fastqwen generate is token-identical to transformers' generate (float32, CPU)."""

import pytest
import torch
from conftest import char_tokenizer, fresh, hf_generate, left_padded

import fastqwen
from fastqwen.generate import PREFILL_CHUNK_TOKENS, DoneWatch

NEW = 64


@pytest.fixture(scope="module", params=["tiny", "tiny-moe"])
def pair(request):
    """(HF reference model, optimized model) with identical weights."""
    ref = fresh(request.param)
    opt = fastqwen.optimize(fresh(request.param), max_batch_size=3, max_seq_len=512, compile=False)
    return ref, opt


@pytest.mark.parametrize("prompt_len", [1, 63, 64, 65, 200])
def test_batch1_matches_hf(pair, prompt_len):
    ref, opt = pair
    ids = torch.randint(0, ref.config.vocab_size, (1, prompt_len))
    expected = hf_generate(ref, ids, max_new_tokens=NEW)
    got = opt.generate(ids, max_new_tokens=NEW, do_sample=False)
    assert got.shape == (1, prompt_len + NEW)
    assert torch.equal(got, expected)


def test_ragged_left_padded_batch_matches_hf_and_single_rows(pair):
    ref, opt = pair
    rows = [torch.randint(1, ref.config.vocab_size, (n,)) for n in (200, 65, 7)]
    ids, mask = left_padded(rows)
    expected = hf_generate(ref, ids, mask, max_new_tokens=NEW)
    got = opt.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(got, expected)
    for b, r in enumerate(rows):
        alone = opt.generate(r[None], max_new_tokens=NEW, do_sample=False)
        assert torch.equal(alone[0, len(r):], got[b, ids.shape[1]:])


@pytest.mark.parametrize("budget, chunks", [(96, (64, 48)), (130, (128, 64))])
def test_chunked_prefill_matches_hf(pair, budget, chunks):
    """Prompts longer than prefill_chunk_tokens prefill in chunks (`chunks`: positions a forward for a row
    alone and for the two equal rows that prefill together; the last chunk is shorter, some below the chunked
    GDN kernel's 64): the output stays transformers'."""
    ref, opt = pair
    engine = opt._fastqwen
    rows = [torch.randint(1, ref.config.vocab_size, (n,)) for n in (150, 150, 9)]
    ids, mask = left_padded(rows)
    engine.prefill_chunk_tokens = budget
    try:
        assert (engine._prefill_chunk(1), engine._prefill_chunk(2)) == chunks
        got = opt.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
        alone = opt.generate(rows[0][None], max_new_tokens=16, do_sample=False)
    finally:
        engine.prefill_chunk_tokens = PREFILL_CHUNK_TOKENS
    assert torch.equal(got, hf_generate(ref, ids, mask, max_new_tokens=16))
    assert torch.equal(alone[0], got[0])


def test_eos_in_the_middle_of_a_batch(pair):
    ref, opt = pair
    rows = [torch.randint(1, ref.config.vocab_size, (n,)) for n in (30, 12, 50)]
    ids, mask = left_padded(rows)
    free = opt.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False)[:, ids.shape[1]:]
    # an EOS that row 1 emits at step 10 and that no row emits before step 4
    eos = int(free[1, 10])
    first_hits = [(r == eos).nonzero() for r in free]
    assert min(int(h[0]) for h in first_hits if len(h)) >= 4
    kw = dict(max_new_tokens=40, eos_token_id=eos, pad_token_id=3)
    expected = hf_generate(ref, ids, mask, **kw)
    got = opt.generate(ids, attention_mask=mask, do_sample=False, **kw)
    assert torch.equal(got, expected)
    new = got[1, ids.shape[1]:]
    stop = int((new == eos).nonzero()[0])
    assert (new[stop + 1:] == 3).all(), "a finished row is padded with pad_token_id"


def test_eos_list_and_all_rows_finish_early(pair):
    ref, opt = pair
    ids = torch.randint(1, ref.config.vocab_size, (2, 9))
    free = opt.generate(ids, max_new_tokens=30, do_sample=False)[:, 9:]
    eos = [int(free[0, 5]), int(free[1, 2])]
    kw = dict(max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
    expected = hf_generate(ref, ids, **kw)
    got = opt.generate(ids, do_sample=False, **kw)
    assert torch.equal(got, expected)
    assert got.shape[1] < 9 + 30, "generation stops once every row has finished"


def test_min_new_tokens_and_max_length(pair):
    ref, opt = pair
    ids = torch.randint(1, ref.config.vocab_size, (1, 10))
    eos = int(opt.generate(ids, max_new_tokens=5, do_sample=False)[0, 10])  # the very first token
    kw = dict(max_new_tokens=12, min_new_tokens=6, eos_token_id=eos)
    got = opt.generate(ids, do_sample=False, **kw)
    assert torch.equal(got, hf_generate(ref, ids, **kw))
    assert not (got[0, 10:16] == eos).any()
    got = opt.generate(ids, max_length=17, do_sample=False)
    assert torch.equal(got, hf_generate(ref, ids, max_length=17))


def test_default_length_is_twenty_new_tokens_as_in_transformers(pair):
    """With no max_new_tokens / max_length anywhere (Qwen's generation_config sets neither), transformers generates
    its default 20 *new* tokens whatever the prompt's length; a max_length that the model's generation_config sets
    is a total length."""
    ref, opt = pair
    ids = torch.randint(1, ref.config.vocab_size, (1, 25))  # longer than 20
    expected = hf_generate(ref, ids)
    assert expected.shape == (1, 45)
    assert torch.equal(opt.generate(ids, do_sample=False), expected)
    for m in (ref, opt):
        m.generation_config.max_length = 30
    try:
        expected = hf_generate(ref, ids)
        assert expected.shape == (1, 30)
        assert torch.equal(opt.generate(ids, do_sample=False), expected)
    finally:
        for m in (ref, opt):
            m.generation_config.max_length = None


def test_an_eos_id_past_the_vocabulary_never_matches(pair):
    """transformers never generates an eos_token_id outside the vocabulary; it is no error there either."""
    ref, opt = pair
    ids = torch.randint(1, ref.config.vocab_size, (1, 9))
    kw = dict(max_new_tokens=6, eos_token_id=[ref.config.vocab_size + 5])
    assert torch.equal(opt.generate(ids, do_sample=False, **kw), hf_generate(ref, ids, **kw))


def test_min_new_tokens_takes_precedence_over_min_length(pair):
    ref, opt = pair
    ids = torch.randint(1, ref.config.vocab_size, (1, 10))
    eos = int(opt.generate(ids, max_new_tokens=5, do_sample=False)[0, 12])  # the third token
    kw = dict(max_new_tokens=12, min_new_tokens=1, min_length=18, eos_token_id=eos)
    expected = hf_generate(ref, ids, **kw)
    assert expected.shape == (1, 13), "transformers stops at the EOS: min_new_tokens replaces min_length"
    assert torch.equal(opt.generate(ids, do_sample=False, **kw), expected)


def test_pad_token_id_masks_left_padding_without_attention_mask(pair):
    """Without an attention_mask transformers infers one from pad_token_id (where that is no EOS): the pad tokens
    of a left-padded batch are padding, not prompt."""
    ref, opt = pair
    rows = [torch.randint(1, ref.config.vocab_size, (n,)) for n in (7, 12, 4)]
    ids, mask = left_padded(rows, pad_id=0)
    kw = dict(max_new_tokens=10, pad_token_id=0)
    expected = hf_generate(ref, ids, **kw)
    assert torch.equal(expected, hf_generate(ref, ids, mask, **kw))
    assert torch.equal(opt.generate(ids, do_sample=False, **kw), expected)
    # a pad_token_id that is also an EOS infers nothing: every token is prompt, as in transformers
    kw = dict(max_new_tokens=10, pad_token_id=0, eos_token_id=0)
    assert torch.equal(opt.generate(ids, do_sample=False, **kw), hf_generate(ref, ids, **kw))
    # a pad token inside a prompt: transformers masks it out, which fastqwen cannot; the error names the fix
    holed = ids.clone()
    holed[1, -3] = 0
    with pytest.raises(ValueError, match=r"pad_token_id=0 inside a prompt.*attention_mask"):
        opt.generate(holed, max_new_tokens=4, pad_token_id=0)


def test_transformers_positional_arguments(pair):
    """generate's positional parameters are transformers' own, in its order: (inputs, generation_config,
    logits_processor, stopping_criteria, …, streamer, …)."""
    from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

    class StopAtLength(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 14, dtype=torch.bool)

    ref, opt = pair
    ids = torch.randint(1, ref.config.vocab_size, (1, 8))
    cfg = GenerationConfig(max_new_tokens=20, do_sample=False)
    args = (ids, cfg, None, StoppingCriteriaList([StopAtLength()]))
    assert torch.equal(opt.generate(*args), type(ref).generate(ref, *args))
    with pytest.raises(ValueError, match="does not support `logits_processor`"):
        opt.generate(ids, cfg, LogitsProcessorList([lambda i, s: s]))
    # values that ask for nothing (an empty list, synced_gpus=False) are accepted
    expected = hf_generate(ref, ids, max_new_tokens=6)
    got = opt.generate(ids, max_new_tokens=6, do_sample=False, logits_processor=LogitsProcessorList(),
                       synced_gpus=False)
    assert torch.equal(got, expected)


def test_return_dict_and_generation_config(pair):
    from transformers import GenerationConfig

    ref, opt = pair
    ids = torch.randint(1, ref.config.vocab_size, (1, 8))
    cfg = GenerationConfig(max_new_tokens=7, do_sample=False)
    out = opt.generate(ids, generation_config=cfg, return_dict_in_generate=True)
    assert torch.equal(out.sequences, hf_generate(ref, ids, max_new_tokens=7))


def test_streamers_see_every_token(pair):
    from transformers.generation.streamers import BaseStreamer

    class Collect(BaseStreamer):
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    ref, opt = pair
    ids = torch.randint(1, ref.config.vocab_size, (1, 8))
    s = Collect()
    out = opt.generate(ids, max_new_tokens=10, do_sample=False, streamer=s)
    assert s.ended and s.chunks[0] == ids[0].tolist()
    assert sum(s.chunks[1:], []) == out[0, 8:].tolist()


def test_stopping_criteria(pair):
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopAtLength(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 14, dtype=torch.bool)

    ref, opt = pair
    ids = torch.randint(1, ref.config.vocab_size, (1, 8))
    out = opt.generate(ids, max_new_tokens=20, do_sample=False, stopping_criteria=StopAtLength())
    assert out.shape[1] == 14
    out = opt.generate(ids, max_new_tokens=20, do_sample=False, stopping_criteria=StoppingCriteriaList([StopAtLength()]))
    assert torch.equal(out, hf_generate(ref, ids, max_new_tokens=6))



def test_stopping_criteria_without_an_eos_let_the_rows_they_end_run_on(pair):
    """Without any eos_token_id transformers pads no row: one that a stopping criterion ends keeps generating until
    the criteria have ended every row (its pad_token_id pads only after an EOS)."""
    from transformers import StoppingCriteria

    class StopRows(StoppingCriteria):  # row 0 at 6 new tokens, row 1 at 10
        def __call__(self, input_ids, scores, **kw):
            return torch.tensor([input_ids.shape[1] >= 14, input_ids.shape[1] >= 18])

    ref, opt = pair
    ids = torch.randint(1, ref.config.vocab_size, (2, 8))
    for kw in (dict(), dict(pad_token_id=5)):
        expected = hf_generate(ref, ids, max_new_tokens=14, stopping_criteria=[StopRows()], **kw)
        assert expected.shape == (2, 18) and torch.equal(expected, hf_generate(ref, ids, max_new_tokens=10))
        got = opt.generate(ids, max_new_tokens=14, do_sample=False, stopping_criteria=[StopRows()], **kw)
        assert torch.equal(got, expected), kw

def test_stop_strings_and_max_time_match_transformers(pair):
    """stop_strings (with the tokenizer that decodes the tokens; one string, or a list) end each row where
    transformers' StopStringCriteria ends it, at different positions in a ragged batch; max_time likewise (a limit
    already passed at the first token: one new token a row); stop_strings without a tokenizer are refused."""
    ref, opt = pair
    tok = char_tokenizer(ref.config.vocab_size)
    rows = [torch.randint(1, ref.config.vocab_size, (n,)) for n in (40, 9, 23)]
    ids, mask = left_padded(rows)
    free = hf_generate(ref, ids, mask, max_new_tokens=16)[:, ids.shape[1]:]
    stop = tok.decode(free[0, 3:5])  # row 0's 4th and 5th tokens: row 0 ends by its 5th
    # an EOS none of them emits, so that transformers pads stopped rows (without one it lets them run on)
    eos = next(t for t in range(ref.config.vocab_size) if t not in free)
    for stops in (stop, [stop, tok.decode(free[2, 8:10])]):
        kw = dict(max_new_tokens=16, stop_strings=stops, tokenizer=tok, eos_token_id=eos, pad_token_id=0)
        expected = hf_generate(ref, ids, mask, **kw)
        got = opt.generate(ids, attention_mask=mask, do_sample=False, **kw)
        assert torch.equal(got, expected), stops
        assert not torch.equal(got[:, ids.shape[1]:], free[:, :got.shape[1] - ids.shape[1]]), "no row was stopped"
    got = opt.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, max_time=1e-9)
    assert torch.equal(got, hf_generate(ref, ids, mask, max_new_tokens=16, max_time=1e-9))
    assert got.shape[1] == ids.shape[1] + 1
    with pytest.raises(ValueError, match=r"stop_strings need the model's tokenizer.*tokenizer=tokenizer"):
        opt.generate(ids, attention_mask=mask, max_new_tokens=4, stop_strings="ab")


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_transformers(pair, penalty):
    """repetition_penalty (> 1 discourages, < 1 favours the tokens already in a row: its prompt, not its left
    padding, and what it generated): token-identical to transformers on a ragged batch, and not the unpenalized
    output; a penalty that is no number > 0 is refused."""
    ref, opt = pair
    rows = [torch.randint(1, ref.config.vocab_size, (n,)) for n in (30, 7, 19)]
    ids, mask = left_padded(rows)
    expected = hf_generate(ref, ids, mask, max_new_tokens=24, repetition_penalty=penalty)
    assert not torch.equal(expected, hf_generate(ref, ids, mask, max_new_tokens=24)), "the penalty changed nothing"
    got = opt.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, repetition_penalty=penalty)
    assert torch.equal(got, expected)
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="repetition_penalty"):
            opt.generate(ids, attention_mask=mask, max_new_tokens=4, repetition_penalty=bad)


def test_num_return_sequences_samples_each_row_that_many_times(pair):
    """num_return_sequences=n with sampling: the batch of its rows each repeated n times in place (transformers'
    order), drawn as that batch would be under the same seed; greedy (transformers' own check), and rows × n over
    max_batch_size, refused."""
    ref, opt = pair
    rows = [torch.randint(1, ref.config.vocab_size, (n,)) for n in (12, 5)]
    ids, mask = left_padded(rows)
    kw = dict(do_sample=True, temperature=2.0, max_new_tokens=12)
    torch.manual_seed(3)
    got = opt.generate(ids[:1], attention_mask=mask[:1], num_return_sequences=3, **kw)
    torch.manual_seed(3)
    assert torch.equal(got, opt.generate(ids[:1].repeat(3, 1), attention_mask=mask[:1].repeat(3, 1), **kw))
    assert len({tuple(r) for r in got[:, ids.shape[1]:].tolist()}) == 3, "the three copies drew the same tokens"
    torch.manual_seed(4)
    got = opt.generate(ids, attention_mask=mask, num_return_sequences=1, **kw)
    torch.manual_seed(4)
    assert torch.equal(got, opt.generate(ids, attention_mask=mask, **kw))
    with pytest.raises(ValueError, match=r"do_sample != True.*num_return_sequences"):  # (transformers' check)
        opt.generate(ids, attention_mask=mask, num_return_sequences=2, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"batch of 2 rows × num_return_sequences 2 exceeds max_batch_size=3"):
        opt.generate(ids, attention_mask=mask, num_return_sequences=2, **kw)
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="num_return_sequences must be an int >= 1"):
            opt.generate(ids, attention_mask=mask, num_return_sequences=bad, **kw)


def conditional_model():
    """A tiny random Qwen3_5ForConditionalGeneration (the text model of the "tiny" preset)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from fastqwen import presets

    text = presets.config("tiny").to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    cfg = Qwen3_5Config(text_config=text, vision_config=vision)
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(cfg).eval()
    presets.perturb_zero_init(model, std=0.1)
    return model


def test_conditional_generation_class_text_only():
    model = conditional_model()
    ids = torch.randint(1, 500, (1, 70))
    expected = hf_generate(model, ids, max_new_tokens=20)
    fastqwen.optimize(model, compile=False, max_seq_len=128)
    assert torch.equal(model.generate(ids, max_new_tokens=20, do_sample=False), expected)



def test_text_only_mm_token_type_ids_as_the_processor_returns_them():
    """Qwen3.5's processor returns mm_token_type_ids beside input_ids, all 0 for a text-only prompt:
    generate(**processor(text=...)) runs as in transformers; a prompt with image or video tokens is refused."""
    model = conditional_model()
    ids = torch.randint(1, 500, (2, 12))
    types = torch.zeros_like(ids)
    expected = hf_generate(model, ids, max_new_tokens=8, mm_token_type_ids=types)
    fastqwen.optimize(model, compile=False, max_batch_size=2, max_seq_len=32)
    assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False, mm_token_type_ids=types), expected)
    types[1, 3] = 1
    with pytest.raises(ValueError, match=r"image or video tokens.*type\(model\).generate"):
        model.generate(ids, max_new_tokens=8, mm_token_type_ids=types)


def test_logits_to_keep_is_taken_as_transformers_takes_it(pair):
    """transformers' generate passes logits_to_keep to the forward (which positions' logits it returns), never
    changing the tokens; it was refused as an unsupported argument. A value no forward takes is still refused."""
    ref, opt = pair
    ids = torch.randint(1, 500, (1, 7))
    expected = hf_generate(ref, ids, max_new_tokens=5, logits_to_keep=0)
    assert torch.equal(opt.generate(ids, max_new_tokens=5, do_sample=False, logits_to_keep=0), expected)
    with pytest.raises(ValueError, match="logits_to_keep must be an int >= 0 or a tensor of positions, got -1"):
        opt.generate(ids, max_new_tokens=5, logits_to_keep=-1)


def test_concurrent_calls_from_threads_take_turns(pair):
    """One optimized model serves one generate at a time (one static cache): a second thread's call, started while
    the first one decodes, waits for it instead of resetting the cache under it (both as when run alone)."""
    import threading

    from transformers.generation.streamers import BaseStreamer

    ref, opt = pair
    a, b = torch.randint(1, ref.config.vocab_size, (1, 30)), torch.randint(1, ref.config.vocab_size, (2, 9))
    alone = [opt.generate(ids, max_new_tokens=12, do_sample=False) for ids in (a, b)]
    got = {}
    second = threading.Thread(target=lambda: got.update(b=opt.generate(b, max_new_tokens=12, do_sample=False)))

    class StartTheSecond(BaseStreamer):  # at the first call's 4th token, the second call starts and gets 1 s
        def __init__(self):
            self.puts = 0

        def put(self, value):
            self.puts += 1
            if self.puts == 4:
                second.start()
                second.join(timeout=1.0)

        def end(self):
            pass

    got["a"] = opt.generate(a, max_new_tokens=12, do_sample=False, streamer=StartTheSecond())
    second.join()
    assert torch.equal(got["a"], alone[0]) and torch.equal(got["b"], alone[1])

    class CallsGenerate(BaseStreamer):  # a call from inside a call (its own thread) is refused, not awaited forever
        def put(self, value):
            opt.generate(b, max_new_tokens=2, do_sample=False)

        def end(self):
            pass

    with pytest.raises(RuntimeError, match="called from inside this model's generate"):
        opt.generate(a, max_new_tokens=12, do_sample=False, streamer=CallsGenerate())
    assert torch.equal(opt.generate(a, max_new_tokens=12, do_sample=False), alone[0])

@pytest.mark.parametrize("lag", [1, 2, 3])
def test_done_watch_runs_lag_minus_one_launches_past_the_end(lag):
    """generate's end-of-decode check: the host reads the "all done" flag `lag` launches late, so exactly
    lag − 1 launches run after the last row finishes (2 − 1 = 1 in generate without a streamer)."""
    done = torch.zeros(2, dtype=torch.bool)
    watch, launches = DoneWatch(done, lag), 0
    while True:
        watch.launched()
        if watch.finished():
            break
        launches += 1  # a "step": row 0 finishes at the 3rd, row 1 at the 5th
        done[0] |= launches >= 3
        done[1] |= launches >= 5
    assert launches == 5 + lag - 1
    done.fill_(True)  # every row ended before the first launch: nothing is launched, whatever the lag
    watch = DoneWatch(done, lag)
    watch.launched()
    assert watch.finished()
