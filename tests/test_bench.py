"""The roofline's byte counts (fastqwen.bench), the benchmark plot, and bench.run's candidates, on the tiny
presets."""

import json
import pathlib
import subprocess
import sys

import pytest
import torch

from fastqwen import bench, presets


def test_weight_bytes_counts_one_embedding_row_per_token():
    model = presets.build("tiny", dtype=torch.float32, device="cpu")
    every = sum(p.numel() for p in model.parameters()) * 4
    table = 512 * 64 * 4  # vocab x hidden, fp32; lm_head is untied and counts in full
    assert bench.weight_bytes(model) == every - table + 64 * 4
    assert bench.weight_bytes(model, 3) == every - table + 3 * 64 * 4


def test_weight_bytes_counts_the_expected_share_of_routed_experts():
    model = presets.build("tiny-moe", dtype=torch.float32, device="cpu")
    experts = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)
    base = bench.weight_bytes(model) - round(experts * 2 / 8)  # 2 of 8 experts for one token
    # two tokens select 1 - (6/8)^2 = 7/16 of the experts on average (uniform routing)
    assert bench.weight_bytes(model, 2) == pytest.approx(base + 64 * 4 + experts * 7 / 16, abs=8)


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_weight_bytes_counts_quantized_weights_in_their_stored_format(preset):
    """fp8-weight: each replaced bf16 weight (2 bytes an element) becomes 1-byte codes plus fp32 row scales."""
    from fastqwen.quant import quantize
    from fastqwen.quant.linear import QuantLinear

    from fastqwen.quant.experts import QuantExperts

    model = presets.build(preset, dtype=torch.bfloat16, device="cpu")
    before = bench.weight_bytes(model)
    bf16_experts = sum(p.numel() * 2 for n, p in model.named_parameters() if ".experts." in n)
    quantize(model, "fp8-weight")
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert linears
    saved = sum(m.in_features * m.out_features - 4 * m.out_features for m in linears)  # (2 - 1) B a weight, 4 B a row
    stored_experts = sum(b.numel() * b.element_size() for m in model.modules() if isinstance(m, QuantExperts)
                         for b in m.buffers())
    assert (stored_experts > 0) == (preset == "tiny-moe")
    # one token reads 2 of the 8 routed experts, in whichever format they are stored
    assert before - bench.weight_bytes(model) - saved == pytest.approx((bf16_experts - stored_experts) / 4, abs=8)


def test_state_bytes_of_the_tiny_shape():
    # 3 Gated DeltaNet layers: fp32 state 4 heads x 16 x 16 read + written (8192 B) and a bf16 conv window of
    # (2*2*16 + 4*16) channels x 3 read + written (1536 B); 1 attention layer: bf16 K and V, 2 heads x 32 dims
    cfg = presets.config("tiny")
    assert bench.state_bytes(cfg, 0) == 3 * (8192 + 1536)
    assert bench.state_bytes(cfg, 100) == 3 * (8192 + 1536) + 100 * 2 * 2 * 32 * 2
    model = presets.build("tiny", dtype=torch.bfloat16, device="cpu")
    assert bench.step_bytes(model, 4, 100) == bench.weight_bytes(model, 4) + 4 * bench.state_bytes(cfg, 100)


def test_decode_speed_cancels_prefill_and_makes_the_calls_asked_for():
    """decode_tok_per_s: (n_long − n_short) / (t_long − t_short) of median call times, after a warm-up at each
    length (the long one skipped when the caller has just made it), timed calls in (short, long) pairs: a fake
    generate with a fixed 'prefill' and 2 ms a token reads ~500 tokens/s, whatever its prefill."""
    import time

    calls = []

    def fake_generate(ids, attention_mask, max_new_tokens, **kw):
        calls.append(max_new_tokens)
        time.sleep(0.05 + 0.002 * max_new_tokens)
        return torch.zeros(ids.shape[0], ids.shape[1] + max_new_tokens)

    ids = torch.zeros(1, 8, dtype=torch.long)
    assert bench.decode_tok_per_s(fake_generate, ids, 4, 40) == pytest.approx(500, rel=0.15)
    assert calls == [40, 4] + [4, 40] * 3
    calls.clear()
    bench.decode_tok_per_s(fake_generate, ids, 4, 40, repeats=1, warmed=True)
    assert calls == [4, 4, 40]


def test_decode_speed_outlasts_a_slow_stretch_and_refuses_persistent_noise():
    """A machine busy through the first round of pairs (short calls stalled: medians read t_long <= t_short)
    gets more rounds, whose samples join the medians; noise that never clears is an error naming the fix."""
    import time

    calls = []

    def stalled_at_first(ids, attention_mask, max_new_tokens, **kw):
        calls.append(max_new_tokens)
        stall = 0.3 if max_new_tokens == 4 and len(calls) <= 6 else 0.0
        time.sleep(stall + 0.002 * max_new_tokens)
        return torch.zeros(ids.shape[0], ids.shape[1] + max_new_tokens)

    ids = torch.zeros(1, 8, dtype=torch.long)
    assert bench.decode_tok_per_s(stalled_at_first, ids, 4, 40, repeats=2, retries=2) > 0
    assert len(calls) == 2 + 2 * 2 * 3  # warm-ups, then three rounds: the medians cleared only in the third

    def always_stalled(ids, attention_mask, max_new_tokens, **kw):
        time.sleep(0.2 if max_new_tokens == 4 else 0.01)
        return torch.zeros(ids.shape[0], ids.shape[1] + max_new_tokens)

    with pytest.raises(RuntimeError, match="timing noise.*medians of 3 calls each.*longer runs"):
        bench.decode_tok_per_s(always_stalled, ids, 4, 40, repeats=1, retries=2)



def test_decode_speed_refuses_lengths_that_time_no_decode(monkeypatch, capsys):
    """n_long <= n_short timed no decode between the calls: equal lengths read 0.0 tok/s (0 tokens over the calls'
    noise), a longer short run "timing noise"; repeats=0 a StatisticsError. Each is refused first, naming the fix."""
    calls = []

    def fake_generate(ids, attention_mask, max_new_tokens, **kw):
        calls.append(max_new_tokens)
        return torch.zeros(ids.shape[0], ids.shape[1] + max_new_tokens)

    ids = torch.zeros(1, 8, dtype=torch.long)
    for n_short, n_long, repeats in ((40, 40, 3), (60, 40, 3), (0, 40, 3), (4, 40, 0)):
        with pytest.raises(ValueError, match=r"n_short >= 1 and n_long > n_short.*repeats >= 1"):
            bench.decode_tok_per_s(fake_generate, ids, n_short, n_long, repeats)
    assert not calls
    for args, message in ((["--n-short", "40", "--n-long", "40"], "n_long > n_short"),
                          (["--kernels", "attention"], "--kernels takes OP=CHOICE, got 'attention'"),
                          (["--options", "combo_kernels"], "--options takes KEY=VALUE, got 'combo_kernels'"),
                          (["--options", "combo_kernels=yes"], "VALUE a Python literal"),
                          (["--batch-size", "1", "0"], "--batch-size: must be a positive int, got 0"),
                          (["--prompt-len", "-4"], "--prompt-len: must be a positive int, got -4")):
        assert message in command_line_error("bench.py", *args, monkeypatch=monkeypatch, capsys=capsys)


def command_line_error(script: str, *args: str, monkeypatch, capsys) -> str:
    """What scripts/<script> run with `args` prints to stderr as it exits with argparse's usage error (2)."""
    import runpy

    monkeypatch.setattr(sys, "argv", [script, *args])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(pathlib.Path(__file__).parents[1] / "scripts" / script), run_name="__main__")
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_bench_spec_refuses_bad_runs_before_timing_anything(monkeypatch, capsys):
    """A malformed --runs entry failed as a bare unpacking error, and a tau past k + 1 (or a k of 0) only after
    the plain decode was compiled and timed (minutes on a GPU): each is refused at the command line."""
    for args, message in ((["--runs", "mtp:3"], "--runs takes proposer:k:tau, got 'mtp:3'"),
                          (["--runs", "mtp:x:2.0"], "--runs takes proposer:k:tau"),
                          (["--runs", "mtp:3:5.0"], r"tau must be in [1, 4] for k=3"),
                          (["--runs", "dflash:0:1.0"], "num_speculative_tokens must be an int in 1..32"),
                          (["--n-short", "40", "--n-long", "40"], "n_long > n_short"),
                          (["--batch", "0"], "--batch: must be a positive int, got 0")):
        assert message in command_line_error("bench_spec.py", *args, monkeypatch=monkeypatch, capsys=capsys)

def test_plot_draws_a_line_and_a_roofline_per_model_and_prompt(tmp_path):
    row = lambda b, p: {"model": "m", "batch_size": b, "prompt_len": p, "roofline_tok_s": 100.0,  # noqa: E731
                        "systems": {"fastqwen": {"tok_s": 50.0}}}
    results = [row(b, p) for p in (512, 32768) for b in (1, 2, 4, 8)] + [{"model": "x", "error": "oom"}]
    src = tmp_path / "bench.json"
    src.write_text(json.dumps({"environment": {"hardware": "H"}, "results": results}))
    subprocess.run([sys.executable, str(pathlib.Path(__file__).parents[1] / "scripts" / "plot_bench.py"), str(src), str(tmp_path / "b.svg")], check=True)
    svg = (tmp_path / "b.svg").read_text()
    assert svg.count("<polyline") == 4 and svg.count("<circle") == 8
    assert "m, prompt 32768" in svg


def test_ragged_rows_step_down_from_the_prompt_length_to_about_half():
    from fastqwen.bench import ragged_mask

    mask = ragged_mask(4, 512, "cpu")
    assert mask.shape == (4, 512) and mask.sum(1).tolist() == [512, 448, 384, 320]
    assert bool((mask[:, -1] == 1).all()) and bool((mask.diff(dim=1) >= 0).all())  # left padding only


def test_run_times_alternatives_against_the_default_on_one_model():
    """bench.run with a kernel candidate and an inductor-option candidate beside fastqwen (tiny, CPU, eager):
    each gets a speed and its ratio to the default, and the table lists them."""
    systems = ("fastqwen", "fastqwen+fla-gdn", "fastqwen+combo-kernels")
    r = bench.run("tiny", systems=systems, prompt_len=16, n_short=2, n_long=24, dtype=torch.float32, device="cpu",
                  compile=False, progress=None)
    for system in systems:
        assert r["systems"][system].get("tok_s", 0) > 0, r["systems"][system]
        assert r["systems"][system]["step_host_us"] > 0 and "step_device_us" not in r["systems"][system]
    assert r["fastqwen+combo-kernels_vs_fastqwen"] > 0 and r["fastqwen+fla-gdn_vs_fastqwen"] > 0
    assert "combo-kernels" in bench.format_table([r])


@pytest.mark.parametrize("tok_s, suspect", [(950.0, False), (1100.0, False), (500.0, True), (1300.0, True)])
def test_a_speed_that_disagrees_with_its_step_device_time_is_marked(monkeypatch, tok_s, suspect):
    """A plain decode whose generate-timed tok/s is more than STEP_AGREEMENT away from 1 / its step's device time
    (1000 tok/s here) is flagged, the warning is said, and the table shows it with a "?"."""
    import types

    monkeypatch.setattr(bench, "step_times", lambda engine: {"step_host_us": 100.0, "step_device_us": 1000.0})
    model = types.SimpleNamespace(_fastqwen=types.SimpleNamespace(spec=None))
    out, said = {"tok_s": tok_s}, []
    bench._time_steps("[x] fastqwen", model, out, said.append)
    assert out["step_tok_s"] == pytest.approx(1000.0)
    assert out.get("timing_suspect", False) is suspect
    assert any("WARNING" in m for m in said) is suspect
    r = {"model": "x", "batch_size": 1, "prompt_len": 8, "systems": {"fastqwen": out, "fastqwen-fp8-weight": out}}
    table = bench.format_table([r])
    assert (f"| {tok_s:.1f}? |" in table and f"fp8-weight {tok_s:.1f}?" in table) is suspect
    assert f"| {tok_s:.1f} |" in table or suspect


def test_run_applies_base_kernels_to_every_fastqwen_system(monkeypatch):
    """bench.run(kernels=..., max_seq_len=...) reaches optimize for fastqwen and the candidates, a candidate's own
    kernel choice winning, in the order the systems were given (a system measured later in a process can run
    slower, so the caller chooses who goes first)."""
    import fastqwen

    seen = []
    real = fastqwen.optimize
    monkeypatch.setattr(fastqwen, "optimize",
                        lambda *a, **k: seen.append((k["kernels"], k["max_seq_len"])) or real(*a, **k))
    r = bench.run("tiny", systems=("fastqwen+serial-launch", "fastqwen", "fastqwen+fla-gdn"), prompt_len=16,
                  n_short=2, n_long=16, dtype=torch.float32, device="cpu", compile=False, progress=None,
                  kernels={"launch": "pdl", "gdn": "unrolled"}, max_seq_len=200)  # (14 tokens apart: not noise)
    assert r["kernels"] == {"launch": "pdl", "gdn": "unrolled"} and r["max_seq_len"] == 200
    assert seen == [({"launch": "serial", "gdn": "unrolled"}, 200), ({"launch": "pdl", "gdn": "unrolled"}, 200),
                    ({"launch": "pdl", "gdn": "fla"}, 200)]
    assert r["fastqwen+serial-launch_vs_fastqwen"] > 0
    with pytest.raises(ValueError, match="max_seq_len=50 < prompt_len"):
        bench.run("tiny", systems=("fastqwen",), prompt_len=16, n_long=4, device="cpu", max_seq_len=50)


def test_option_systems_name_real_inductor_options():
    """Each inductor-option system's keys exist in this torch's inductor config (a typo would only fail on
    the GPU, where those systems compile)."""
    import torch._inductor.config as config

    for options in bench.OPTION_SYSTEMS.values():
        for key in options:
            node = config
            for part in key.split("."):
                assert hasattr(node, part), key
                node = getattr(node, part)


def test_run_gives_a_quantized_system_the_roofline_of_its_own_bytes():
    """bench.run with fastqwen-fp8-weight (tiny, CPU, eager): its roofline counts fp8 codes, so it sits above
    the bf16 model's, and the table reports the speed against it."""
    r = bench.run("tiny", systems=("fastqwen", "fastqwen-fp8-weight"), prompt_len=16, n_short=2, n_long=24,
                  dtype=torch.bfloat16, device="cpu", compile=False, progress=None, quant_lm_head=True)
    assert r["systems"]["fastqwen-fp8-weight"].get("tok_s", 0) > 0, r["systems"]
    assert r["fastqwen-fp8-weight_roofline_tok_s"] > 1.3 * r["roofline_tok_s"]
    assert "of its roofline" in bench.format_table([r])


def test_run_times_a_quantized_system_under_an_alternative_kernel(monkeypatch):
    """A quantized variant ("fastqwen-fp8-weight+serial-launch") reaches optimize with its scheme and its own
    kernels, after the plain quantized system, on the same (already quantized) model, and is reported against it;
    two schemes in one run are refused."""
    import fastqwen

    seen = []
    real = fastqwen.optimize
    monkeypatch.setattr(fastqwen, "optimize", lambda *a, **k: seen.append((k["quant"], k["kernels"])) or real(*a, **k))
    systems = ("fastqwen", "fastqwen-fp8-weight", "fastqwen-fp8-weight+serial-launch")
    r = bench.run("tiny", systems=systems, prompt_len=16, n_short=2, n_long=24, dtype=torch.bfloat16, device="cpu",
                  compile=False, progress=None)
    assert seen == [(None, {}), ("fp8-weight", {}), ("fp8-weight", {"launch": "serial"})]
    variant = r["systems"]["fastqwen-fp8-weight+serial-launch"]["tok_s"]
    assert r["fastqwen-fp8-weight+serial-launch_vs_fastqwen-fp8-weight"] == (
        variant / r["systems"]["fastqwen-fp8-weight"]["tok_s"])
    assert "fp8-weight+serial-launch" in bench.format_table([r])
    with pytest.raises(ValueError, match="one scheme"):
        bench.run("tiny", systems=("fastqwen-int4", "fastqwen-fp8-weight+serial-launch"), device="cpu")


def test_bench_spec_times_candidate_kernels_against_the_default(tmp_path):
    """scripts/bench_spec.py on the tiny CPU model (eager: the script's plumbing; compiled steps are
    tests/test_compile.py's): a DFlash run, then verify + commit re-timed under another GDN kernel in the same
    process, each with its ratio to the default's."""
    out = tmp_path / "spec.json"
    script = pathlib.Path(__file__).parents[1] / "scripts" / "bench_spec.py"
    subprocess.run([sys.executable, str(script), "--runs", "dflash:3:2.0", "--n-short", "4", "--n-long", "28",
                    "--verify-block", "4", "--phases", "--also-kernels", "gdn=fla", "--no-compile", "--json",
                    str(out)],
                   check=True, capture_output=True)
    res = json.loads(out.read_text())
    run = res["dflash"]
    assert run["tok_s"] > 0 and res["verify4"]["verify_s"] > 0
    assert run["window_rounds"] > 0 and run["window_tau"] == (28 - 4) / run["window_rounds"]
    assert run["tok_s_e2e_at_tau"] == pytest.approx(run["tok_s"] * 2.0 / run["window_tau"])
    alt = res["also_kernels"]["gdn=fla"]
    assert alt["verify_s"] > 0 and alt["verify_vs_default"] == alt["verify_s"] / res["verify4"]["verify_s"]


def test_bench_isolate_times_each_system_in_a_process_of_its_own(tmp_path):
    """scripts/bench.py --isolate --processes 2 --options … (tiny, CPU): a quantized system and the default each
    timed in two fresh processes (rounds in alternating order), merged into one row: each system's tok/s and step the
    medians of its processes, listed beside; the ratio taken across processes from the medians."""
    out = tmp_path / "bench.json"
    script = pathlib.Path(__file__).parents[1] / "scripts" / "bench.py"
    systems = ["fastqwen-fp8-weight", "fastqwen"]
    bad = subprocess.run([sys.executable, str(script), "--processes", "2", "--systems", "fastqwen"],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "more than 1 only with --isolate" in bad.stderr
    subprocess.run([sys.executable, str(script), "--isolate", "--processes", "2", "--systems", *systems,
                    "--prompt-len", "16", "--n-short", "2", "--n-long", "24", "--json", str(out),
                    "--options", "triton.enable_pdl=True"], check=True, capture_output=True)
    (row,) = json.loads(out.read_text())["results"]
    assert row["isolated"] and list(row["systems"]) == systems
    assert row["compile_options"]["triton.enable_pdl"] is True  # (--options: every system's, recorded)
    assert not [out["error"] for out in row["systems"].values() if "error" in out]  # (22 tokens: not timing noise)
    procs = {s: row["systems"][s]["processes"] for s in systems}
    assert len({p["pid"] for s in systems for p in procs[s]}) == 4 and all(len(p) == 2 for p in procs.values())
    for s in systems:
        assert row["systems"][s]["tok_s"] == pytest.approx(sum(p["tok_s"] for p in procs[s]) / 2)
    tok_s = {s: row["systems"][s]["tok_s"] for s in systems}
    assert row["fastqwen-fp8-weight_vs_bf16"] == tok_s["fastqwen-fp8-weight"] / tok_s["fastqwen"]
    assert row["fastqwen-fp8-weight_roofline_tok_s"] > row["roofline_tok_s"]



def test_bench_isolate_merges_every_processs_bandwidth_and_suspect_mark():
    """scripts/bench.py's merge of --isolate --processes 2 rows (one system a process): the roofline (each process
    measures the copy bandwidth) is the median over the processes, not the first one's (the quantized roofline
    not the last one's), and a process whose tok/s disagreed with its step (timing_suspect) marks the merged tok/s,
    which it is half of; step_tok_s follows the median step."""
    import runpy

    cli = runpy.run_path(str(pathlib.Path(__file__).parents[1] / "scripts" / "bench.py"))

    def row(system, tok_s, step_us, roof, quant_roof=None, suspect=False):
        out = {"tok_s": tok_s, "step_device_us": step_us, "step_tok_s": 1e6 / step_us, "pid": tok_s}
        r = {"model": "m", "batch_size": 1, "prompt_len": 8, "copy_bandwidth_Bps": roof * 1e9,
             "roofline_tok_s": roof, "systems": {system: {**out, **({"timing_suspect": True} if suspect else {})}}}
        return {**r, **({"fastqwen-fp8-weight_roofline_tok_s": quant_roof} if quant_roof else {})}

    same = [row("fastqwen", 100.0, 10000.0, 200.0), row("fastqwen-fp8-weight", 150.0, 6600.0, 210.0, 330.0),
            row("fastqwen-fp8-weight", 152.0, 6500.0, 204.0, 320.0),
            row("fastqwen", 130.0, 9800.0, 202.0, suspect=True)]
    merged = cli["merge_rows"](same)
    fq = merged["systems"]["fastqwen"]
    assert fq["tok_s"] == 115.0 and fq["step_device_us"] == 9900.0
    assert fq["step_tok_s"] == pytest.approx(1e6 / 9900.0)
    assert fq.get("timing_suspect") is True and "| 115.0? |" in bench.format_table([merged])
    assert merged["roofline_tok_s"] == 203.0 and merged["copy_bandwidth_Bps"] == 203e9
    assert merged["fastqwen-fp8-weight_roofline_tok_s"] == 325.0
    assert merged["fastqwen_vs_roofline"] == pytest.approx(115.0 / 203.0)


def test_bench_spec_times_the_verify_on_a_shorter_stack(tmp_path):
    """bench_spec.py --layers 2 --runs: plain decode and a 4-position verify + commit on the first two layers; a
    DFlash run is refused there (its draft taps layers of the whole stack)."""
    out = tmp_path / "spec.json"
    script = pathlib.Path(__file__).parents[1] / "scripts" / "bench_spec.py"
    bad = subprocess.run([sys.executable, str(script), "--layers", "2", "--runs", "dflash:3:2.0"], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "taps layers of the whole stack" in bad.stderr
    subprocess.run([sys.executable, str(script), "--layers", "2", "--runs", "--n-short", "4", "--n-long", "28",
                    "--verify-block", "4", "--no-compile", "--json", str(out)], check=True,
                   capture_output=True)
    res = json.loads(out.read_text())
    assert res["layers"] == 2 and res["plain_tok_s"] > 0 and res["verify4"]["verify_s"] > 0


def test_timings_can_cycle_through_weight_copies_larger_than_l2(monkeypatch):
    """bench.graph_seconds(variants=...) calls fn on each argument set in turn (every one at least once), modules
    among the arguments too, and cold_copies asks for enough copies that twice the L2 cache streams between two reads of one copy."""
    seen = []
    t = bench.graph_seconds(lambda x, w: seen.append(w), variants=[(torch.ones(1), i) for i in range(25)], calls=4)
    assert t > 0 and set(seen) == set(range(25))
    lin = torch.nn.Linear(2, 2)  # (modules count by their tensors: a CUDA module's calls are timed as a graph)
    assert not bench._on_cuda(lin) and not bench._on_cuda(torch.ones(1)) and not bench._on_cuda(3)
    assert bench.graph_seconds(lambda m: m(torch.ones(1, 2)), variants=[(lin,)], calls=2) > 0
    assert bench.cold_copies(10, "cpu") == 1
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"L2_cache_size": 50 << 20}))
    assert [bench.cold_copies(n << 20, "cuda") for n in (31, 50, 100, 101, 1300)] == [4, 2, 1, 1, 1]


def test_profile_step_tells_a_rounds_draft_and_verify_apart(tmp_path):
    """scripts/profile_step.py --speculate dflash:3 --phases on the tiny CPU model, eager (--again, below,
    profiles compiled steps): the decode step, the round, then the draft and the verify each profiled apart."""
    out = tmp_path / "profile.json"
    script = pathlib.Path(__file__).parents[1] / "scripts" / "profile_step.py"
    subprocess.run([sys.executable, str(script), "--speculate", "dflash:3", "--phases", "--steps", "2", "--top", "3",
                    "--no-compile", "--json", str(out)], check=True, capture_output=True)
    report = json.loads(out.read_text())
    assert [r["what"] for r in report] == ["step", "dflash:3 round", "dflash draft", "verify (4)"]
    assert all(r["step_us"] > 0 and r["kernels"] for r in report)


def test_profile_step_times_a_verify_alone_on_a_shorter_stack(tmp_path):
    """profile_step.py --layers 2 --verify-block 4 (eager): the decode step and a 4-position verify with no
    proposer, on the first two layers of the tiny preset."""
    out = tmp_path / "profile.json"
    script = pathlib.Path(__file__).parents[1] / "scripts" / "profile_step.py"
    subprocess.run([sys.executable, str(script), "--layers", "2", "--verify-block", "4", "--steps", "2", "--top", "3",
                    "--no-compile", "--json", str(out)], check=True, capture_output=True)
    assert [r["what"] for r in json.loads(out.read_text())] == ["step", "verify (4) alone"]
    with pytest.raises(ValueError, match="layers must be in 1"):
        presets.build("tiny", layers=0)
    assert presets.build("tiny", layers=2).config.layer_types == presets.config("tiny").layer_types[:2]


def test_profile_step_again_profiles_a_second_engine_and_lists_the_changes(tmp_path):
    """profile_step.py --again on the tiny CPU model: the step, then the step of a second optimize of the same
    model (the first engine released), and a table of the kernels' changes between them."""
    out = tmp_path / "profile.json"
    script = pathlib.Path(__file__).parents[1] / "scripts" / "profile_step.py"
    run = subprocess.run([sys.executable, str(script), "--layers", "1", "--again", "--steps", "2", "--top", "3",
                          "--json", str(out)], check=True, capture_output=True, text=True)
    report = json.loads(out.read_text())
    assert [r["what"] for r in report] == ["step", "step, optimized again"]
    assert all(r["step_us"] > 0 and r["kernels"] for r in report)
    assert "| kernel | µs before | µs after | change |" in run.stdout


def test_bench_gdn_checks_each_kernel_against_the_reference(tmp_path):
    """scripts/bench_gdn.py on CPU: the reference's row, timed, with its error against itself."""
    out = tmp_path / "gdn.json"
    script = pathlib.Path(__file__).parents[1] / "scripts" / "bench_gdn.py"
    subprocess.run([sys.executable, str(script), "--T", "3", "--json", str(out)], check=True, capture_output=True)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["T"], r["kernel"]) for r in rows] == [(3, "reference")] and rows[0]["us"] > 0


def test_bench_quant_merges_sweep_tables(tmp_path):
    """Sweeps split over GPUs write partial tables; --merge-tables folds them into one, later parts winning."""
    parts = [tmp_path / "a.json", tmp_path / "b.json"]
    parts[0].write_text(json.dumps({"H200": {"0:1x128:M1": [32, 1, 4, 4], "0:2x128:M1": [64, 1, 4, 4]}}))
    parts[1].write_text(json.dumps({"H200": {"0:2x128:M1": [128, 2, 4, 2]}, "B200": {"0:1x128:M1": [32, 2, 4, 4]}}))
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"H200": {"3:5x128:M1": [32, 1, 4, 4]}}))
    script = pathlib.Path(__file__).parents[1] / "scripts" / "bench_quant.py"
    subprocess.run([sys.executable, str(script), "--merge-tables", *map(str, parts), "--write-table", str(table)],
                   check=True, capture_output=True)
    assert json.loads(table.read_text()) == {
        "H200": {"3:5x128:M1": [32, 1, 4, 4], "0:1x128:M1": [32, 1, 4, 4], "0:2x128:M1": [128, 2, 4, 2]},
        "B200": {"0:1x128:M1": [32, 2, 4, 4]}}


def test_quant_quality_calibrates_its_logit_error_with_weight_noise(tmp_path):
    """scripts/quant_quality.py on the tiny model: a scheme's row and a noise row, each with the per-linear error
    it was built to have (the noise row exactly ε, fp8-weight e4m3's few percent) and a logit error above it."""
    script = pathlib.Path(__file__).parents[1] / "scripts" / "quant_quality.py"
    out = tmp_path / "q.json"
    subprocess.run([sys.executable, str(script), "--model", "tiny", "--positions", "8", "--schemes", "fp8-weight",
                    "--noise", "0.01", "--json", str(out)], check=True, capture_output=True)
    rows = json.loads(out.read_text())["schemes"]
    assert rows["noise 0.01"]["linear_rel_err_median"] == pytest.approx(0.01, rel=0.1)
    assert 0.01 < rows["fp8-weight"]["linear_rel_err_median"] < 0.05
    for r in rows.values():
        assert r["rel_err"] > r["linear_rel_err_median"] and 0 <= r["top1_agreement"] <= 1


def test_gemv_fit_recovers_a_known_line(tmp_path):
    """scripts/gemv_fit.py on a gemv_times.py table whose times are exactly 4 µs + bytes ÷ 3 TB/s for one kernel and
    1.5 µs + bytes ÷ 4 TB/s for another (split counts and errors differing per row, as in real tables): each fit
    gives back its line, the two kept apart, and a kernel timed at one size is left out (no line through a point)."""
    rows = []
    for i, mb in enumerate((16.5, 38.4, 46.7, 93.3, 665.5)):
        rows.append(f"|  | l{i} | 1x1 | M=1 | cuda batch 2 folded splits {i + 1} (error {i}e-06) | "
                    f"{4 + mb / 3:.4f} µs | {mb} MB | 0 TB/s |")
        rows.append(f"|  | l{i} | 1x1 | M=1 | cuda batch 2 splits {i + 2} LOADS ONLY | {1.5 + mb / 4:.4f} µs | {mb} MB | "
                    "0 TB/s |")
    rows.append("|  | l0 | 1x1 | M=4 | cuda batch 2 folded splits 2 | 9.0 µs | 16.5 MB | 0 TB/s |")
    table = tmp_path / "t.md"
    table.write_text("# a title\n" + "\n".join(rows) + "\n")
    script = pathlib.Path(__file__).parents[1] / "scripts" / "gemv_fit.py"
    out = subprocess.run([sys.executable, str(script), str(table)], check=True, capture_output=True, text=True).stdout
    fits = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")]
                                              for line in out.splitlines()[2:])}
    assert fits == {"cuda batch 2 folded": ["1", "5", "4.00", "3.00", "0.00"],
                    "cuda batch 2 LOADS ONLY": ["1", "5", "1.50", "4.00", "0.00"]}


def test_gemv_times_keeps_the_loads_only_probe_where_the_pair_kernel_is_the_default(monkeypatch):
    """scripts/gemv_times.py's instance filter: with the pair kernel the default (--cuda-pair 1) the loads-only
    probe, which has no pair form, is still timed up to 8 rows (it was skipped, so an H200 fit of 2026-12-06 got
    no probe line); past 8 rows it is not; up to 8 rows one instance a BATCH (the first pair choice's), past 8
    every pair choice."""
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parents[1] / "scripts"))
    from gemv_times import timed_at

    probe, one = (2, False, 4096, True, False, 0), (2, False, 4096, False, 1, 1)
    unpaired = (2, False, 4096, False, 1, 0)
    assert timed_at(probe, 1, 1, True) and timed_at(probe, 8, 1, True) and not timed_at(probe, 9, 1, True)
    assert timed_at(one, 1, 1, True) and not timed_at(unpaired, 1, 1, True)
    assert timed_at(one, 16, 1, True) and timed_at(unpaired, 16, 1, True)
    assert timed_at(unpaired, 1, 0, True) and timed_at((4, False, 4096, False, 0, 0), 1, 1, True)
    assert timed_at((2, False, 4096, False, 0, 0), 1, 1, False)  # (fp8: no pair field to match)
