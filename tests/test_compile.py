"""The compiled decode step: same tokens as eager, one graph, no recompilation across calls."""

import contextlib
import logging
import os

import pytest
import torch
from conftest import fresh, left_padded, run_in_triton_interpreter
from torch._dynamo.utils import counters

import fastqwen


@contextlib.contextmanager
def post_grad_graphs():
    """Collects the graphs inductor compiles in the block, as its post-grad passes leave them (FX graph cache
    off: a hit skips the passes)."""
    graphs = []

    class Keep(logging.Handler):
        def emit(self, record):
            graphs.append(record.getMessage())

    log, handler = logging.getLogger("torch._inductor.compile_fx.__post_grad_graphs"), Keep()
    log.addHandler(handler)
    torch._logging.set_logs(post_grad_graphs=True)
    try:
        with torch._inductor.config.patch(fx_graph_cache=False):
            yield graphs
    finally:
        torch._logging.set_logs()
        log.removeHandler(handler)


def assert_writes_the_stacked_cache_in_place(graph: str) -> None:
    """Each layer's cache writes (conv window, KV, verify inputs) go into the stacked cache buffers in place, by
    index_put_ or by our ops that write them (conv_decode, attention_prep): no select_scatter / slice_scatter /
    functional index_put, nor a custom op's auto_functionalized, is left, each of which is a rewrite of a whole
    stacked buffer (all layers) per layer (HybridCache.write)."""
    assert "index_put_.default" in graph or "fastqwen.attention_prep.default" in graph
    for functional in ("select_scatter", "slice_scatter", "aten.index_put.default", "auto_functionalized"):
        assert functional not in graph, functional


def test_compiled_step_matches_eager_and_never_recompiles():
    """The decode step compiled (one graph, no recompiles across calls) gives the eager tokens, and writes the
    conv windows in place."""
    eager = fastqwen.optimize(fresh("tiny"), max_batch_size=3, max_seq_len=128, compile=False)
    compiled = fastqwen.optimize(fresh("tiny"), max_batch_size=3, max_seq_len=128, compile=True)
    torch._dynamo.reset()
    counters.clear()
    calls = [
        left_padded([torch.randint(1, 500, (n,)) for n in (9, 30)]),
        (torch.randint(1, 500, (1, 70)), None),
        left_padded([torch.randint(1, 500, (n,)) for n in (5, 64, 17)]),
    ]
    for i, (ids, mask) in enumerate(calls):
        expected = eager.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
        if i == 0:
            with post_grad_graphs() as compiled_graphs:
                got = compiled.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
            graphs = counters["stats"]["unique_graphs"]
            assert graphs == 1 and len(compiled_graphs) == 1
            assert_writes_the_stacked_cache_in_place(compiled_graphs[0])
        else:
            with torch._dynamo.config.patch(error_on_recompile=True):
                got = compiled.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
        assert torch.equal(got, expected)
    assert counters["stats"]["unique_graphs"] == graphs, "a later call compiled a new graph"
    assert sum(counters["recompiles"].values()) == 0


@pytest.mark.parametrize("speculate", [None, "dflash", "mtp"])
def test_no_compiled_step_has_a_tensor_input_cudagraphs_would_copy(speculate, tmp_path, monkeypatch):
    """cudagraph trees copy every tensor input of a compiled graph that is neither a module's parameter or
    buffer nor marked static (torch._dynamo.mark_static_address) into the graph's own copy before each replay:
    a launch (and for a table, its bytes) every step. The decode step and the DFlash and MTP rounds take none:
    the inputs dynamo hands inductor are all static (main copied Forward's inv_freq every step until
    2026-12-06; a table of every position would have been ~1 MB a step)."""
    import torch._inductor.compile_fx as compile_fx
    from test_dflash import write_draft
    from test_mtp import write_checkpoint

    copied, graphs, inner = [], [], compile_fx.compile_fx

    def spy(gm, inputs, *args, **kwargs):
        graphs.append(gm)
        copied.extend(n.name for n in gm.graph.nodes if n.op == "placeholder"
                      and isinstance(n.meta.get("example_value"), torch.Tensor)
                      and not n.meta.get("tensor_dict", {}).get("_dynamo_static_input_type"))
        return inner(gm, inputs, *args, **kwargs)

    monkeypatch.setattr(compile_fx, "compile_fx", spy)  # (torch.compile's inductor backend imports it per call)
    model = fresh("tiny")
    draft = {None: None, "dflash": lambda: write_draft(tmp_path / "dflash"),
             "mtp": lambda: write_checkpoint(tmp_path / "mtp", model) or str(tmp_path / "mtp")}[speculate]
    torch._dynamo.reset()
    model = fastqwen.optimize(model, max_seq_len=128, compile=True, speculate=speculate,
                              draft=draft and draft())
    model.generate(torch.randint(1, 500, (1, 9)), max_new_tokens=12, do_sample=False)
    assert graphs and not copied, copied


def test_compile_cache_carries_compiled_graphs_to_a_fresh_process(tmp_path):
    """warmup() saves the compiled artifacts; a new process with an empty inductor cache loads them and
    compiles nothing from scratch (FX graph cache hits, no misses). One layer of the tiny preset: the cache's
    plumbing, not the model, is under test (37.7 -> 26.9 s here)."""
    import os
    import subprocess
    import sys

    script = f"""
import sys, torch
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
from conftest import fresh
from torch._dynamo.utils import counters
import fastqwen
m = fastqwen.optimize(fresh("tiny", layers=1), max_seq_len=64, compile=True, compile_cache={str(tmp_path / 'artifacts.bin')!r})
m._fastqwen.warmup()
print("HITS", counters["inductor"]["fxgraph_cache_hit"], "MISSES", counters["inductor"]["fxgraph_cache_miss"])
"""

    def run(cache_dir):
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir))
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        line = next(line for line in out.stdout.splitlines() if line.startswith("HITS"))
        return int(line.split()[1]), int(line.split()[3])

    hits, misses = run(tmp_path / "inductor-a")
    assert misses > 0 and (tmp_path / "artifacts.bin").exists()
    hits, misses = run(tmp_path / "inductor-b")  # an empty local cache: only the artifacts file can help
    assert hits > 0 and misses == 0


def test_a_compile_cache_file_torch_cannot_read_is_named_before_warmup_overwrites_it(tmp_path):
    """A damaged, truncated or foreign file at compile_cache (a mistyped path: the checkpoint's config.json) was
    skipped with torch's log line alone, which names no file, and warmup() then overwrote it without a word."""
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "qwen3_5_text"}')
    message = r"compile_cache '.*config.json' holds no compiled artifacts .* warmup\(\) will overwrite it"
    with pytest.warns(UserWarning, match=message):
        fastqwen.optimize(fresh("tiny", layers=1), max_seq_len=32, compile=True, compile_cache=str(path))

def test_compiled_repetition_penalty_matches_eager():
    """With repetition_penalty the plain step and the speculative round compile graphs of their own (the default
    ones take no penalty work) and give the eager tokens."""
    from fastqwen.bench import OracleProposer

    eager = fastqwen.optimize(fresh("tiny"), max_batch_size=2, max_seq_len=128, compile=False)
    compiled = fastqwen.optimize(fresh("tiny"), max_batch_size=2, max_seq_len=128, compile=True)
    ids, mask = left_padded([torch.randint(1, 500, (n,)) for n in (9, 30)])
    kw = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, repetition_penalty=1.3)
    expected = eager.generate(ids, **kw)
    assert torch.equal(compiled.generate(ids, **kw), expected)
    assert set(compiled._fastqwen._penalized_steps) == {False}
    compiled._fastqwen.enable_speculation(OracleProposer(expected[:, ids.shape[1]:], 0.35, 512), 3)
    assert torch.equal(compiled.generate(ids, **kw), expected)
    assert set(compiled._fastqwen.spec._fewer) == {(3, False, True)}


@pytest.mark.parametrize("kernels", [{}, {"conv": "fused"}])
def test_compiled_speculative_round_matches_eager_decoding(kernels):
    """The speculative round (verify, accept, the stacked-cache commit) compiled into one graph gives the
    plain eager tokens, with the optimize-time 3 drafts and with 2 asked for per call (its own graph), and
    calls after the first of each compile nothing new; each round graph stashes the verify inputs in place
    (by default the verify_prologue op writes every replay input into the stacked buffers' views; with "fused"
    the model does)."""
    from fastqwen.bench import OracleProposer

    eager = fastqwen.optimize(fresh("tiny"), max_batch_size=2, max_seq_len=128, compile=False)
    spec = fastqwen.optimize(fresh("tiny"), max_batch_size=2, max_seq_len=128, compile=True, kernels=kernels)
    oracle = OracleProposer(torch.zeros(2, 20, dtype=torch.long), 0.35, spec.config.vocab_size)
    spec._fastqwen.enable_speculation(oracle, 3)
    for i, (ids, mask) in enumerate([left_padded([torch.randint(1, 500, (n,)) for n in (9, 30)]),
                                     left_padded([torch.randint(1, 500, (n,)) for n in (21, 4)])] * 2):
        expected = eager.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
        oracle.reference = expected[:, ids.shape[1]:].contiguous()  # same shape and strides: no recompile
        k = 3 if i < 2 else 2
        compiles = i % 2 == 0
        with post_grad_graphs() if compiles else contextlib.nullcontext() as compiled_graphs, \
                torch._dynamo.config.patch(error_on_recompile=not compiles):
            got = spec.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, num_speculative_tokens=k)
        if compiles:  # (k = 2: a block shorter than the cache's, its replay stash padded with zeros)
            assert len(compiled_graphs) == 1
            assert_writes_the_stacked_cache_in_place(compiled_graphs[0])
        assert torch.equal(got, expected)
        assert 1.0 < spec._fastqwen.spec.acceptance_length(2) < k + 1


def test_the_source_digest_changes_with_any_source_file(tmp_path):
    """Another fastqwen (an op's shape heuristic changed, its schema not) must not be served this one's steps."""
    from fastqwen.generate import source_digest

    (tmp_path / "ops").mkdir()
    (tmp_path / "ops" / "gemv.py").write_text("SPLITS = 8\n")
    (tmp_path / "notes.md").write_text("not source")
    first = source_digest(str(tmp_path))
    (tmp_path / "notes.md").write_text("edited")
    assert source_digest(str(tmp_path)) == first
    (tmp_path / "ops" / "gemv.py").write_text("SPLITS = 4\n")
    assert source_digest(str(tmp_path)) != first
    assert len(source_digest()) == 64


def test_compiled_steps_are_cached_under_a_tag_of_the_ops_and_the_launch_table(monkeypatch):
    """torch's cache key misses a custom op's schema, so generate runs (and compiles) under a cache_key_tag that
    changes with fastqwen's op schemas and the gemv launch table, and puts the user's tag back afterwards."""
    from fastqwen import reductions
    from fastqwen.generate import compile_cache_tag

    schemas = ["fastqwen::f(Tensor x, bool a=False) -> Tensor"]
    assert compile_cache_tag(schemas, {}) == compile_cache_tag(list(schemas), {})
    assert compile_cache_tag(schemas, {}) != compile_cache_tag(["fastqwen::f(Tensor x) -> Tensor"], {})
    assert compile_cache_tag(schemas, {}) != compile_cache_tag(schemas, {"H200": {"0:1x128:M1": [32, 1, 4, 4]}})
    assert compile_cache_tag(schemas, {}, "a") != compile_cache_tag(schemas, {}, "b")  # (fastqwen's source)
    assert "wq_linear" in str(torch.ops.fastqwen.wq_linear.default._schema)  # (the default gathers these)

    model = fastqwen.optimize(fresh("tiny"), max_batch_size=1, max_seq_len=64, compile=False)
    engine = model._fastqwen
    seen = []
    decode = engine._decode
    monkeypatch.setattr(engine, "_decode", lambda *a: seen.append(torch.compiler.config.cache_key_tag) or decode(*a))
    with torch.compiler.config.patch(cache_key_tag="users-own"):
        model.generate(torch.randint(1, 500, (1, 5)), max_new_tokens=3)
        assert torch.compiler.config.cache_key_tag == "users-own"
    assert engine.reductions == "persistent"  # (the default: its heuristic changes the kernels, so it is tagged)
    assert seen == [compile_cache_tag() + reductions.tag("persistent")] and seen[0].startswith("fastqwen-")



def test_split_k_partials_fold_into_their_consumers_kernel_at_any_split_count():
    """Linears and QuantLinear add a GEMV's split-K partials with gemv.add_splits: compiled, the adds join the
    consumer's kernel (here a residual add and its RMSNorm: one kernel) at 2, 8 and 16 partials, where
    parts.sum(0), a reduction inductor unrolls into its consumer only below 8 terms, is a kernel of its own at 8
    and 16 (the control: the int4 CUDA kernel's 8 splits on the 27B's o / out and down projections launched two
    such sums a layer). Inductor's Triton codegen on CPU tensors in a subprocess (scripts/decode_kernels.py)."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "decode_kernels.py")
    code = (f"import runpy, torch\nfrom fastqwen.ops.gemv import add_splits\n"
            f"names = runpy.run_path({script!r})['kernel_names']\n"
            "def norm(x, parts, w, add):\n"
            "    y = x + add(parts).to(x.dtype)\n"
            "    return (y.float() * torch.rsqrt(y.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w, y\n"
            "for S in (2, 8, 16):\n"
            "    for how, add in (('chain', add_splits), ('sum', lambda p: p.sum(0))):\n"
            "        args = (torch.randn(1, 512).bfloat16(), torch.randn(S, 1, 512), torch.randn(512).bfloat16())\n"
            "        print(S, how, len(names(lambda x, p, w: norm(x, p, w, add), *args)))\n")
    lines = run_in_triton_interpreter(code, interpret=False).strip().splitlines()[-6:]
    kernels = {(int(S), how): int(n) for S, how, n in (line.split() for line in lines)}
    assert all(kernels[S, "chain"] == 1 for S in (2, 8, 16)), kernels
    assert kernels[2, "sum"] == 1 and kernels[8, "sum"] == 2 and kernels[16, "sum"] == 2, kernels


def decode_kernel_names(*kernels: str, verify: int = 0) -> list:
    """The tiny model's decode-step inductor kernels (with `verify` T: a speculative verify's of T positions)
    under optimize's `kernels` (OP=CHOICE, linears=gemv first): inductor's Triton codegen on CPU tensors in a
    subprocess (scripts/decode_kernels.py: the kernels are written, not compiled)."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "decode_kernels.py")
    argv = ["decode_kernels", "--names", "--kernels", "linears=gemv", *kernels] + ["--verify", str(verify)] * bool(verify)
    code = f"import runpy, sys; sys.argv = {argv!r}; runpy.run_path({script!r}, run_name='__main__')"
    return eval(run_in_triton_interpreter(code, interpret=False).strip().splitlines()[-1])


def test_decode_step_norms_are_our_kernels_by_default():
    """By default (kernels "gdn_norm" "kernel", "attn_glue" "fused") no inductor kernel of the decode step
    holds the GDN gated norm, the attention q/k norms and rope, the KV-cache write or the output gate: our ops
    do (ops/gated_norm.py, ops/attention_prep.py, decode_attention.merge_gated_op), and fewer kernels are left
    than with inductor's (the test below). Nor does any compute the rope's cos and sin: attention_prep reads the
    model's tables at the positions (given cos and sin of the step's positions, inductor wrote them with a
    kernel before each attention layer's op)."""
    names = decode_kernel_names()
    assert not [n for n in names if "_cos_" in n or "_sin_" in n], names
    assert not [n for n in names if "index_put" in n or "sigmoid" in n], names
    assert len(names) < len(decode_kernel_names("gdn_norm=separate", "attn_glue=separate")), names


def test_verify_prologue_leaves_the_verify_no_conv_or_gate_kernel():
    """kernels={"conv": "fused-verify"} (the default): a speculative verify's GDN layers launch no inductor kernel
    for the conv (the window's cat, the taps, silu), the gates (-exp(A_log), softplus, sigmoid) or their replay
    writes: the verify_prologue op does all of it; with "fused" inductor writes those kernels (the control), more
    of them."""
    default = decode_kernel_names("conv=fused", verify=5)
    fused = decode_kernel_names(verify=5)
    gates_or_conv = ("softplus", "sigmoid", "exp_neg", "transpose")
    assert [n for n in default if any(part in n for part in gates_or_conv)], default
    assert not [n for n in fused if any(part in n for part in gates_or_conv)], fused
    assert len(fused) < len(default), (fused, default)


def test_a_verify_writes_its_positions_once():
    """A verify's positions (lengths + t) come from step_positions, an op whose output every attention op
    reads: written inline, inductor copied them into a new buffer for each op of ours reading them (an
    `arange` kernel twice an attention layer, 32 a 27B verify)."""
    names = decode_kernel_names(verify=5)
    assert not [n for n in names if "arange" in n], names


def test_decode_step_norms_fuse_with_their_consumers():
    """With inductor's glue (kernels "gdn_norm" and "attn_glue" "separate") each per-head norm of the decode
    step is one inductor kernel with what consumes it. The GDN gated
    RMSNorm (a reduction per head, then w·x̂·silu(z)): its output reaches out_proj's op per head
    (Linears.heads), so the pointwise tail indexes as the reduction does; reshaped to [rows, Hv·Dv] before the
    op it ran as a reduction kernel and a pointwise one. The attention q and k norms with their rope (apply_rope
    as one pointwise expression), k's with its write into the cache: rotating and concatenating, they ran as a
    reduction kernel, then a kernel per part of the cat. The split-KV op reads a decode step's positions from
    the cache's lengths (a kernel wrote them before each attention op)."""
    names = decode_kernel_names("gdn_norm=separate", "attn_glue=separate")
    gated = [n for n in names if "rsqrt" in n and "silu" in n]
    assert gated and all(n.startswith(("triton_per_", "triton_red_")) for n in gated), names
    roped = [n for n in names if "rsqrt" in n and "cos" in n]  # q's and k's
    assert len(roped) == 2 and all(n.startswith(("triton_per_", "triton_red_")) for n in roped), names
    assert sum("index_put" in n for n in roped) == 1, names  # k's, written into the cache by the same kernel
    # one decode position is the cache's lengths itself (a view): no kernel writes positions for the attention op
    # (q's norm + rope kernel carries the op's name, as on the GPU: its output is the op's q)
    assert not any("split_kv_partials" in n and "rsqrt" not in n for n in names), names


def test_persistent_reductions_hold_a_few_rows_of_up_to_8192_in_one_pass():
    """kernels["reductions"]="persistent" (fastqwen/reductions.py): a reduction over 1024 < n ≤ 8192 elements on
    ≤ 16 rows (the residual add + RMSNorm with a GEMV's 8 split-K partials added in, at 5120 and 8192) compiles to
    a persistent kernel (triton_per_: one pass) where inductor alone writes a looped one (triton_red_); wider rows
    and more rows keep inductor's choice. Through optimize, a decode step's residual norms at hidden size 2048 are
    persistent under "persistent" and looped by default, its other kernels alike. Inductor's Triton codegen on CPU
    tensors in a subprocess (scripts/decode_kernels.py)."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "decode_kernels.py")
    code = (f"import re, runpy, torch, fastqwen\nfrom torch._inductor.virtualized import V\n"
            "from fastqwen import presets, reductions\nfrom fastqwen.ops.gemv import add_splits\n"
            f"ns = runpy.run_path({script!r})\n"
            "def norm(x, parts, w):\n"
            "    y = x + add_splits(parts).to(x.dtype)\n"
            "    return (y.float() * torch.rsqrt(y.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w, y\n"
            "for rows, width in ((1, 5120), (16, 8192), (1, 16384), (64, 5120)):\n"
            "    x, w = torch.randn(rows, width).bfloat16(), torch.randn(width).bfloat16()\n"
            "    args = (x, torch.randn(8, rows, width), w)\n"
            "    default = ns['kernel_names'](norm, *args)\n"
            "    with V.set_choices_handler(reductions.PersistentRows()):\n"
            "        persistent = ns['kernel_names'](norm, *args)\n"
            "    kinds = (','.join(n.split('_fused')[0] for n in k) for k in (default, persistent))\n"
            "    print('norm', rows, width, *kinds)\n"
            "for choice in ('inductor', 'persistent'):\n"
            "    torch._dynamo.reset()\n"
            "    with ns['written_kernels']() as codes:\n"
            "        m = fastqwen.optimize(presets.build('tiny', hidden_size=2048), max_seq_len=64, compile=True,\n"
            "                              kernels={'linears': 'gemv', 'reductions': choice})\n"
            "        try:\n"
            "            m.generate(torch.randint(1, 500, (1, 9)), max_new_tokens=3, do_sample=False)\n"
            "        except Exception:\n"
            "            pass\n"
            "    step = [c for c in codes if 'gdn_decode' in c][0]\n"
            "    names = re.findall(r'\\n\\s+(triton_\\w+)\\.run\\(', step)\n"
            "    print('step', choice, m._fastqwen.cache_tag.endswith(reductions.tag(choice)), ' '.join(names))\n")
    lines = run_in_triton_interpreter(code, interpret=False).strip().splitlines()
    kinds = {(int(r), int(w)): (d, p) for _, r, w, d, p in (line.split() for line in lines if line.startswith("norm "))}
    assert kinds[1, 5120] == kinds[16, 8192] == ("triton_red", "triton_per"), kinds
    assert kinds[64, 5120] == ("triton_red", "triton_red"), kinds  # (more rows: inductor's own choice)
    # wider: inductor splits the row into chunks summed by a second kernel; the chunks' kernel may be persistent
    default, persistent = (k.split(",") for k in kinds[1, 16384])
    assert len(default) == len(persistent) > 1 and "triton_red" in default, kinds
    steps = {choice: (tagged, names.split()) for _, choice, tagged, names in
             (line.split(" ", 3) for line in lines if line.startswith("step "))}
    assert steps["inductor"][0] == steps["persistent"][0] == "True", steps
    kernels = {c: [n.split("_fused")[0] for n in names] for c, (_, names) in steps.items()}
    norms = {c: [k for k, n in zip(kernels[c], steps[c][1]) if "rsqrt" in n and "cos" not in n and "silu" not in n]
             for c in steps}
    assert norms["inductor"] and set(norms["inductor"]) == {"triton_red"}, steps
    assert len(norms["persistent"]) == len(norms["inductor"]) and set(norms["persistent"]) == {"triton_per"}, steps
    assert len(kernels["persistent"]) == len(kernels["inductor"]), steps


def test_fused_attention_glue_takes_the_attention_layers_kernels_from_inductor():
    """kernels["attn_glue"]="fused": an attention layer's q/k norms, rope and k / v cache writes are one op of
    ours, its splits' merge and output gate another, so the decode step's inductor kernels lose all of them (none
    rotates, writes the cache, takes a softmax or a sigmoid) and gain none (the prep reads cos and sin from the
    model's tables: given them at the step's positions, inductor wrote them before each layer's op). Inductor's
    Triton codegen on CPU tensors in a subprocess (scripts/decode_kernels.py), the tiny model."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "decode_kernels.py")
    code = (f"import runpy\nns = runpy.run_path({script!r})\n"
            "for glue in ('separate', 'fused'):\n"
            "    code = ns['decode_step_code']('tiny', None, {'linears': 'gemv', 'attn_glue': glue})\n"
            "    counts = ns['launches'](code)\n"
            "    print(glue, sum(counts.values()), ','.join(n for n, c in counts.items() for _ in range(c)))\n")
    lines = run_in_triton_interpreter(code, interpret=False).strip().splitlines()[-2:]
    (_, n_default, default), (_, n_fused, fused) = (line.split() for line in lines)
    default, fused = default.split(","), fused.split(",")
    from fastqwen import presets

    layers = presets.config("tiny").layer_types.count("full_attention")
    roped = [n for n in default if "rsqrt" in n and "cos" in n]
    assert layers and len(roped) == 2 * layers and sum("index_put" in n for n in default) == 2 * layers, default
    assert sum("softmax" in n for n in default) == 2 * layers and sum("sigmoid" in n for n in default) == layers
    assert not any(w in n for n in fused for w in ("index_put", "softmax", "sigmoid")), fused
    assert not any("rsqrt" in n and "cos" in n for n in fused), fused
    assert not any("cos" in n or "sin" in n for n in fused), fused
    assert int(n_fused) == len(fused) == int(n_default) - 5 * layers, (n_default, n_fused)


def test_gated_norm_kernel_takes_the_gdn_gated_norm_from_inductor():
    """kernels["gdn_norm"]="kernel": the GDN block's gated RMSNorm is our op, which sums z's split-K partials
    itself, so the decode step's inductor kernels lose the one a GDN layer that normed and gated (a reduction
    with silu), and nothing else. Inductor's Triton codegen on CPU tensors in a subprocess, the tiny model."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "decode_kernels.py")
    code = (f"import runpy\nns = runpy.run_path({script!r})\n"
            "for norm in ('separate', 'kernel'):\n"
            "    counts = ns['launches'](ns['decode_step_code']('tiny', None, {'linears': 'gemv', 'gdn_norm': norm}))\n"
            "    print(norm, ','.join(n for n, c in counts.items() for _ in range(c)))\n")
    lines = run_in_triton_interpreter(code, interpret=False).strip().splitlines()[-2:]
    (_, default), (_, ours) = (line.split() for line in lines)
    default, ours = default.split(","), ours.split(",")
    from fastqwen import presets

    layers = presets.config("tiny").layer_types.count("linear_attention")
    gated = [n for n in default if "rsqrt" in n and "silu" in n]
    assert layers and len(gated) == layers, default
    assert not any("rsqrt" in n and "silu" in n for n in ours) and len(ours) == len(default) - layers, ours
